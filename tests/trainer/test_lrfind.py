"""The learning-rate finder: the model, optimizer and random generators given come back bitwise unchanged
(a fit after it equals a fit without it), the sweep's rates and its rule by hand, the plot, the command
line within 80 columns, and two DDP ranks (gloo) that sweep together."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import QUIET, TinyNet, dist_procs, make_classification
from torchrig.config import ConfigError
from torchrig.trainer.lrfind import RULE, suggest

pytestmark = pytest.mark.usefixtures("restore_threads")


def _data():
    x, y = make_classification(n=64)
    return TensorDataset(x, y)


def _trainer(make_trainer, **kw):
    torch.manual_seed(0)
    return make_trainer(TinyNet(dropout=0.2), optimizer="sgd", momentum=0.9, batch_size=8, **kw)


def test_the_model_optimizer_and_generators_are_left_bitwise_unchanged(make_trainer, tmp_path):
    data = _data()
    probed = _trainer(make_trainer, run_dir=str(tmp_path / "a"))
    probed.fit(data)  # momentum buffers now hold state
    model = copy.deepcopy(probed.model.state_dict())
    state = copy.deepcopy(probed.optimizers["default"].state_dict())
    rng = torch.get_rng_state()
    result = probed.find_lr(data, steps=40, plot=tmp_path / "lr.png")
    assert all(torch.equal(v, model[k]) for k, v in probed.model.state_dict().items())
    after = probed.optimizers["default"].state_dict()
    assert after["param_groups"] == state["param_groups"]
    assert all(torch.equal(after["state"][i]["momentum_buffer"], s["momentum_buffer"]) for i, s in state["state"].items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(result.lrs) >= 3 and (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"
    # what follows does not depend on the sweep: a second fit equals that of a twin that never swept
    probed.cfg.epochs = 2
    probed.fit(data)
    twin = _trainer(make_trainer, run_dir=str(tmp_path / "b"))
    twin.fit(data)
    twin.cfg.epochs = 2
    twin.fit(data)
    for a, b in zip(probed.model.parameters(), twin.model.parameters()):
        assert torch.equal(a, b)


def test_the_sweep_and_its_rule(make_trainer, tmp_path):
    result = _trainer(make_trainer).find_lr(_data(), start_lr=1e-4, end_lr=1.0, steps=9, diverge=1e9, plot=False)
    assert result.lrs == pytest.approx([1e-4 * 10 ** (i / 2) for i in range(9)])  # 4 decades in 9 steps
    assert result.plot is None and result.rule == RULE
    # the rule by hand: steepest fall of the curve against log10(lr), before its minimum (index 6)
    lrs = [10.0 ** -k for k in range(8, 0, -1)]
    curve = [2.3, 2.3, 2.2, 1.9, 1.0, 0.6, 0.5, 3.0]
    assert suggest(lrs, curve) == (lrs[4], lrs[6])  # slopes (centred): -0.05, -0.15, -0.6, -0.65, -0.25
    assert suggest(lrs, [1, 2, 3, 4]) == (None, lrs[0])  # never falls: no suggestion
    assert math.isclose(result.lrs[-1], 1.0)


def test_errors_are_one_line(make_trainer):
    trainer = _trainer(make_trainer)
    with pytest.raises(ConfigError, match=r"needs 0 < start_lr < end_lr and at least 3 steps, got start_lr=1\.0"):
        trainer.find_lr(_data(), start_lr=1.0, end_lr=0.1)
    gan = make_trainer(torch.nn.ModuleDict({"G": torch.nn.Linear(8, 8), "D": torch.nn.Linear(8, 1)}),
                       optimizer={"G": "adam", "D": "adam"})
    with pytest.raises(ConfigError, match=r"find_lr sweeps one optimizer; this Trainer has 2 \(G, D\)"):
        gan.find_lr(_data())


def test_the_command_fits_80_columns(tmp_path, monkeypatch, capsys):
    from torchrig.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["lr-find", "--steps", "60", "--start-lr", "1e-5", "--set", "log.progress=none"]) == 0
    out = capsys.readouterr().out
    assert "torchrig: lr-find · 60 steps · lr 1e-05 to 10" in out or "torchrig: lr-find ·" in out
    assert "torchrig: suggested lr " in out and "torchrig: train with it: --set optim.lr=" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert (tmp_path / "lr_find.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_two_ddp_ranks_sweep_together(tmp_path):
    r = dist_procs.torchrig(["launch", "--nproc-per-node", "2", "--", "lr-find", "--steps", "60", "--start-lr", "1e-5",
                             "--out", "ddp.png", *[f"--set={s}" for s in ("log.progress=none", "log.tensorboard=false")]],
                            timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.output[-3000:]
    assert r.stdout.count("torchrig: suggested lr ") == 1  # rank 0 speaks; both ranks finished the same sweep
    assert "2 process(es)" not in r.output and (tmp_path / "ddp.png").exists()
    assert QUIET
