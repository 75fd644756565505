"""float8 training through torchao (``float8``): which Linear layers convert, the plain model's checkpoints, and
training within a documented tolerance of float32 (emulated on the CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import QUIET, dist_procs
from helpers import dist_worker as W
from safetensors.torch import load_file
from torch import nn

import torchrig
from torchrig.config import ConfigError

pytest.importorskip("torchao")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.odd = nn.Linear(32, 24 + 6)   # 30 out features: not a multiple of 16
        self.head = nn.Linear(30, 4)

    def forward(self, x):
        return self.head(self.odd(x + self.down(torch.relu(self.up(x)))))


def data(n=768):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    noise = torch.randint(0, 4, (n,), generator=g)  # a quarter of the labels random: the loss stays well above 0
    return x, torch.where(torch.rand(n, generator=g) < 0.25, noise, x[:, :4].argmax(1))


def _fit(run_dir, recipe=None, **kw):
    torch.manual_seed(0)
    model = Net()
    trainer = torchrig.Trainer(model, "adamw", **QUIET, run_dir=str(run_dir), batch_size=16, lr=0.01, num_workers=0,
                               float8=recipe, checkpoint={"every_epochs": 0}, **kw)
    trainer.fit(data())
    return trainer, model


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_within_tolerance_of_float32_and_saves_the_plain_model(tmp_path, capsys, recipe):
    from torchao.float8.float8_linear import Float8Linear

    plain_trainer, plain = _fit(tmp_path / "fp32", max_steps=48)
    f8_trainer, f8 = _fit(tmp_path / "f8", recipe, max_steps=48)
    assert ("torchrig: float8 training (torchao, " + recipe + " scaling, emulated on cpu: no speed-up there) on 2 "
            "Linear layers; left in high precision: odd (dimensions not multiples of 16), head (the output head)") \
        in capsys.readouterr().err
    assert [type(m) for m in (f8.up, f8.down, f8.odd, f8.head)] == [Float8Linear, Float8Linear, nn.Linear, nn.Linear]
    # documented tolerance (docs/performance.md): the final training loss within 0.05 of float32's after 48 steps
    losses = [t.history[-1]["train/loss"] for t in (plain_trainer, f8_trainer)]
    assert abs(losses[0] - losses[1]) < 0.05, losses
    assert losses[1] < 1.3  # it learned (chance is ln 4 = 1.39)
    saved = load_file(tmp_path / "f8" / "checkpoints" / "latest" / "model.safetensors")
    assert sorted(saved) == sorted(Net().state_dict()) and {t.dtype for t in saved.values()} == {torch.float32}
    bare = Net()
    bare.load_state_dict(saved)  # the plain model loads the float8 run's weights
    assert all(torch.equal(a, b) for a, b in zip(bare.state_dict().values(), f8.state_dict().values()))


def test_a_float8_run_resumes_bitwise(tmp_path):
    _, whole = _fit(tmp_path / "whole", "tensorwise", max_steps=8)
    _fit(tmp_path / "cut", "tensorwise", max_steps=4)
    _, resumed = _fit(tmp_path / "cut", "tensorwise", max_steps=8, resume="latest")
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


def test_skip_patterns_and_a_fused_head_are_left_in_high_precision():
    from torchrig.optim import float8

    cfg = torchrig.load_config(overrides=["float8.recipe=rowwise", "float8.skip=[d*]"])
    assert float8.plan(Net(), cfg.float8, None) == (["up"], {"down": "float8.skip", "odd": "dimensions not multiples "
                                                             "of 16", "head": "the output head"})
    assert float8.plan(Net(), cfg.float8, "up")[0] == []


def test_a_model_with_nothing_to_convert_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'float8.recipe': tensorwise converts none of Sequential's "
                                          r"Linear layers \(left: 0 \(dimensions not multiples of 16\), 1 \(the output "
                                          r"head\)\);"):
        torchrig.Trainer(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), float8="tensorwise",
                         run_dir=str(tmp_path), **QUIET)


def test_float8_with_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match=r"^config key 'float8.recipe': rowwise with parallel.tp=2 is not supported "
                                          r"yet"):
        torchrig.load_config(overrides=["float8.recipe=rowwise", "parallel.tp=2", "parallel.tp_plan=auto"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_float8_runs_natively_or_is_refused_by_capability(tmp_path):
    from torchrig.optim import float8

    if torch.cuda.get_device_capability() >= float8.MIN_CAPABILITY:
        assert float8.emulated(torch.device("cuda"), "tensorwise") is False
    else:
        with pytest.raises(ConfigError, match="compute capability 8.9 or later"):
            float8.emulated(torch.device("cuda"), "tensorwise")


@pytest.mark.slow
def test_float8_all_gather_under_fsdp2_resumes_bitwise_and_checkpoints_the_plain_weights(tmp_path):
    from torchrig.checkpoint import sharded

    assert torchrig.load_config(overrides=["float8.recipe=tensorwise"]).float8.fsdp_all_gather is True
    for rank, r in enumerate(dist_procs.pair("float8", tmp_path, tmp_path / "init-store", timeout=150)):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    found = torch.load(tmp_path / "float8.pt")
    assert found["gathers_float8"] == "WeightWithDynamicFloat8CastTensor"  # torchao's all-gather hooks are on
    assert all(torch.equal(found["whole"][k], found["cut"][k]) for k in found["whole"])  # resumed at step 3: bitwise
    for name in ("whole", "cut"):
        folder = tmp_path / name / "checkpoints" / "latest"
        saved = load_file(folder / "model.safetensors")
        assert all(torch.isfinite(v).all() for v in saved.values())
        assert sorted(saved) == sorted(found[name]) and all(torch.equal(saved[k], found[name][k]) for k in saved)
        bare = W.make_model()
        sharded.load(bare, {}, folder)  # the DCP shards, into one plain process
        assert all(torch.equal(v, found[name][k]) for k, v in bare.state_dict().items())
