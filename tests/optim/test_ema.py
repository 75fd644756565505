"""EMA of the weights (``ema_decay``, ``ema_warmup``): the average itself, exact resume, evaluation with
it (labelled, and different from the trained weights), ``ema.safetensors`` for the bare model, and
2-rank DDP / FSDP2 runs over gloo."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QUIET, TinyNet, dist_procs, make_classification
from helpers import dist_worker as W
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig.config import ConfigError
from torchrig.optim.ema import EMA


class Interrupted(Exception):
    pass


def _data():
    x, y = make_classification(n=38)  # batches of 8: 5 an epoch, the last of 6
    return TensorDataset(x, y), TensorDataset(x[:16], y[:16])


def _trainer(run_dir, **kw):
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=8, epochs=3, lr=0.1, optimizer="adamw", num_workers=0,
                ema_decay=0.8, ema_warmup=True, checkpoint_every=2, resume="latest")
    opts.update(kw)
    return torchrig.Trainer(TinyNet(dropout=0.2), **opts)


def test_update_is_the_moving_average_with_warmup():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = EMA(model, decay=0.9, warmup=True)
    expected = None
    for n in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        now = [p.detach().clone() for p in model.parameters()]
        d = min(0.9, (1 + n) / (10 + n))
        expected = now if expected is None else [e + (1 - d) * (w - e) for e, w in zip(expected, now)]
        for e, s in zip(expected, ema.shadow):
            torch.testing.assert_close(s, e, rtol=0, atol=1e-6)
    assert ema.num_updates == 5 and [s.dtype for s in ema.shadow] == [torch.float32] * 2


def test_resume_with_ema_is_bitwise_equal_to_uninterrupted(tmp_path):
    train, val = _data()
    whole = _trainer(tmp_path / "whole")
    whole.fit(train, val_data=val)

    part = _trainer(tmp_path / "part")
    real = part._save

    def save(metrics=None, final=False):  # stop right after the checkpoint of step 10 (epoch 2's last, short window)
        path = real(metrics=metrics, final=final)
        if part.global_step == 10:
            raise Interrupted
        return path

    part._save = save
    with pytest.raises(Interrupted):
        part.fit(train, val_data=val)
    resumed = _trainer(tmp_path / "part")
    resumed.fit(train, val_data=val)
    assert resumed.resumed_from.name == "step-00000010"
    assert resumed.ema.num_updates == whole.ema.num_updates == 15
    for a, b in zip(whole.ema.shadow, resumed.ema.shadow):
        assert torch.equal(a, b)
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    a = load_file(tmp_path / "whole" / "checkpoints" / "latest" / "ema.safetensors")
    b = load_file(tmp_path / "part" / "checkpoints" / "latest" / "ema.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluate_uses_ema_differs_from_raw_and_says_so(tmp_path, capsys):
    train, val = _data()
    t = _trainer(tmp_path / "run", epochs=2, ema_decay=0.95, progress="lines")
    t.fit(train, val_data=val)
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert said.count("torchrig: evaluation uses the EMA weights (ema_decay=0.95") == 1  # once, at the first eval
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with_ema, raw = t.evaluate(val), t.evaluate(val, ema=False)
    assert with_ema["loss"] != raw["loss"]
    assert t.history[-1]["val/loss"] == pytest.approx(with_ema["loss"])  # fit's validation used the EMA too
    assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in before.items())  # trained weights put back
    bare = TinyNet(dropout=0.2).eval()
    bare.load_state_dict(load_file(tmp_path / "run" / "checkpoints" / "latest" / "ema.safetensors"))
    x, y = val.tensors
    with torch.no_grad():
        loss = nn.functional.cross_entropy(bare(x), y).item()
    assert loss == pytest.approx(with_ema["loss"], rel=1e-6)


def test_ema_safetensors_loads_into_the_bare_model(tmp_path):
    train, _ = _data()
    t = _trainer(tmp_path / "run", epochs=1)
    t.fit(train)
    folder = tmp_path / "run" / "checkpoints" / "latest"
    ema, trained = load_file(folder / "ema.safetensors"), load_file(folder / "model.safetensors")
    bare = TinyNet()
    bare.load_state_dict(ema)  # strict: every key of the model, nothing else
    assert all(torch.equal(ema[n], s) for n, s in zip(t.ema.names, t.ema.shadow))
    assert not torch.equal(ema["head.weight"], trained["head.weight"])


def test_off_by_default_and_values_are_checked(tmp_path):
    t = torchrig.Trainer(TinyNet(), **QUIET, run_dir=str(tmp_path / "r"))
    assert t.ema is None
    for key, value in (("ema_decay", 1.0), ("ema_decay", 0), ("ema_warmup", 3), ("checkpoint.async_save", 2)):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            torchrig.Trainer(TinyNet(), **QUIET, run_dir=str(tmp_path / "r"), **{key: value})


@pytest.mark.slow
def test_ema_under_ddp_and_fsdp2_two_ranks(tmp_path):
    results = dist_procs.pair("ema", tmp_path, tmp_path / "init-store", timeout=120)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    reports = [json.loads((tmp_path / f"ema-{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0] == reports[1]  # every rank evaluates the same weights to the same numbers
    for name in ("ddp", "fsdp"):
        found = reports[0][name]
        assert found["ema"]["loss"] != found["raw"]["loss"]
        assert found["updates"] == found["restored_updates"] == 24
        assert found["restored_equal"]
        saved = load_file(tmp_path / name / "checkpoints" / "latest" / "ema.safetensors")
        bare = W.make_model()
        bare.load_state_dict(saved)
        gathered = torch.load(tmp_path / f"ema-{name}.pt")
        assert all(torch.equal(saved[k], gathered[k]) for k in saved)
    ddp, fsdp = torch.load(tmp_path / "ema-ddp.pt"), torch.load(tmp_path / "ema-fsdp.pt")
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) < 1e-5
    for kind in ("ema", "raw"):  # FSDP2 evaluates the EMA shards it swapped in, as DDP does the full weights
        assert reports[0]["fsdp"][kind]["loss"] == pytest.approx(reports[0]["ddp"][kind]["loss"], rel=1e-5)


# ----------------------------------------------------------------------------- skipped and accumulation windows


def _nan_in(window: int, micro: int):
    """A step function that feeds NaN features to micro-batch ``micro`` (0-based) of optimizer window ``window``
    (1-based, counted over the whole run): that window's loss and gradients are NaN."""
    from torchrig.trainer import default_step

    def step_fn(step, batch):
        if step.global_step + 1 == window and step.batch_index % step.window_size == micro:
            x, y = batch
            batch = (x * float("nan"), y)
        return default_step(step, batch)

    return step_fn


def _hand_ema(applied: list, skipped: set, windows: int, decay: float) -> list:
    """The average with warm-up over ``windows`` optimizer windows, from the parameters after each applied update
    (``applied``, in order): a skipped window leaves the average as it is but counts for the warm-up."""
    e, it = None, iter(applied)
    current = None
    for n in range(windows):
        if n + 1 not in skipped:
            current = next(it)
        if e is None:
            e = [p.clone() for p in current]  # the first update starts from the weights
            continue
        if n + 1 in skipped:
            continue
        d = min(decay, (1 + n) / (10 + n))
        e = [a + (1 - d) * (p - a) for a, p in zip(e, current)]
    return e


@pytest.mark.parametrize("accumulate, skip_micro", [(1, 0), (3, 1)], ids=["whole_batches", "accumulation"])
def test_ema_stands_still_on_a_skipped_window_and_moves_once_per_window(tmp_path, accumulate, skip_micro):
    """38 samples in micro-batches of 4 (the last of 2): with accumulate=3 an epoch is windows of 3, 3, 3 and 1
    micro-batches. A NaN micro-batch in window 6 (epoch 2; with accumulation its middle micro-batch) skips that
    window: the EMA must not move there, and must move once per window, never per micro-batch."""
    x, y = make_classification(n=38)
    per_epoch = 10 if accumulate == 1 else 4
    bad = 6 if accumulate == 3 else per_epoch + 4
    class Snapshots:  # after the EMA's own on_step_end: the average at the end of each window
        def __init__(self):
            self.rows = []

        def on_step_end(self, trainer, outputs):
            self.rows.append([s.clone() for s in trainer.ema.shadow])

    snaps = Snapshots()
    t = _trainer(tmp_path / "run", batch_size=4, epochs=2, accumulate=accumulate, optimizer="sgd", lr=0.1,
                 on_nonfinite="skip", checkpoint_every=0, resume=None, step_fn=_nan_in(bad, skip_micro),
                 callbacks=[snaps])
    applied = []  # the parameters after every update the optimizer really made
    t.optimizers["default"].register_step_post_hook(
        lambda *a: applied.append([p.detach().clone() for p in t.model.parameters()]))
    t.fit(TensorDataset(x, y))
    windows = 2 * per_epoch
    assert t.global_step == windows and t.skipped_steps == 1 and len(applied) == windows - 1
    assert t.ema.num_updates == windows and len(snaps.rows) == windows  # one update per window
    before, after = snaps.rows[bad - 2], snaps.rows[bad - 1]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the EMA moved on a skipped window"
    want = _hand_ema(applied, {bad}, windows, 0.8)
    for got, w in zip(t.ema.shadow, want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-6)
