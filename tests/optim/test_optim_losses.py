"""Capability 1: names for optimizers, losses and schedulers; per-group learning rates."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TinyNet, read_jsonl
from torch import nn

from torchrig.optim.losses import build_loss
from torchrig.optim.optimizers import NameError_, build_optimizer, build_scheduler, param_groups

# ----------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("name,cls,check", [
    ("sgd", torch.optim.SGD, {"momentum": 0.9, "nesterov": False}),
    ("adam", torch.optim.Adam, {"betas": (0.9, 0.999)}),
    ("adamw", torch.optim.AdamW, {"weight_decay": 0.0}),
    ("adagrad", torch.optim.Adagrad, {}),
    ("rmsprop", torch.optim.RMSprop, {"momentum": 0.0}),
    ("SGD", torch.optim.SGD, {}),
])
def test_optimizer_names(name, cls, check):
    opt = build_optimizer(name, TinyNet(), 0.01)
    assert type(opt) is cls
    assert opt.param_groups[0]["lr"] == 0.01
    for k, v in check.items():
        assert opt.param_groups[0][k] == v


def test_sgd_momentum_nesterov_and_weight_decay():
    opt = build_optimizer("sgd", TinyNet(), 0.1, momentum=0.8, nesterov=True, weight_decay=1e-4)
    g = opt.param_groups[0]
    assert (g["momentum"], g["nesterov"], g["weight_decay"]) == (0.8, True, 1e-4)


def test_adam_betas_eps_and_options():
    opt = build_optimizer("adamw", TinyNet(), 0.1, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.05,
                          options={"amsgrad": True})
    g = opt.param_groups[0]
    assert (g["betas"], g["eps"], g["weight_decay"], g["amsgrad"]) == ((0.8, 0.95), 1e-6, 0.05, True)


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(NameError_) as err:
        build_optimizer("adamx", TinyNet(), 0.1)
    msg = str(err.value)
    assert "unknown optimizer 'adamx'" in msg and "; did you mean 'adam'?" in msg
    assert "Valid names: sgd, adam, adamw, adagrad, rmsprop" in msg


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "adagrad", "rmsprop"])
def test_every_optimizer_trains_through_trainer(name, make_trainer, data):
    trainer = make_trainer(optimizer=name, lr=0.01, checkpoint_every_epochs=0)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.fit(data)
    assert trainer.global_step == 5
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_unknown_optimizer_through_trainer(make_trainer):
    with pytest.raises(NameError_, match="unknown optimizer 'lion'.*Valid names: sgd, adam, adamw, adagrad, rmsprop"):
        make_trainer(optimizer="lion")


def test_optimizer_instance_keeps_its_param_groups(make_trainer):
    model = TinyNet()
    opt = torch.optim.SGD([{"params": model.backbone.parameters(), "lr": 1e-4},
                           {"params": model.head.parameters()}], lr=1e-2, momentum=0.5)
    trainer = make_trainer(model, optimizer=opt)
    assert trainer.optimizers["default"] is opt
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 1e-2]


def test_optimizer_factory(make_trainer, data):
    made = []

    def factory(params):
        made.append(torch.optim.SGD(params, lr=0.3))
        return made[-1]

    trainer = make_trainer(optimizer=factory)
    assert len(made) == 1 and trainer.optimizers["default"] is made[0]
    assert {id(p) for p in made[0].param_groups[0]["params"]} == {id(p) for p in trainer.model.parameters()}
    steps = []
    made[0].register_step_post_hook(lambda *a: steps.append(1))
    trainer.fit(data)
    assert len(steps) == trainer.global_step == 5  # the factory's optimizer is the one that steps


def test_bad_optimizer_object(make_trainer):
    with pytest.raises(TypeError) as err:
        make_trainer(optimizer=3)
    assert str(err.value) == "optimizer 'default' must be a name, a torch.optim.Optimizer or a callable(params), got int"


# ----------------------------------------------------------------------------- per-group learning rates


def test_group_lr_by_module_prefix():
    model = TinyNet()
    groups = param_groups(model, 0.1, {"backbone": 1e-4, "head": 1e-2})
    by_name = {g["name"]: g for g in groups}
    assert by_name["backbone"]["lr"] == 1e-4 and by_name["head"]["lr"] == 1e-2
    assert {id(p) for p in by_name["backbone"]["params"]} == {id(p) for p in model.backbone.parameters()}
    assert {id(p) for p in by_name["head"]["params"]} == {id(p) for p in model.head.parameters()}
    assert "default" not in by_name  # every parameter matched a prefix


def test_group_lr_rest_uses_lr_and_longest_prefix_wins():
    model = TinyNet()
    groups = {g["name"]: g for g in param_groups(model, 0.1, {"backbone": 1e-4, "backbone.0.bias": 1e-3})}
    assert [p.shape for p in groups["backbone.0.bias"]["params"]] == [model.backbone[0].bias.shape]
    assert len(groups["backbone"]["params"]) == 1  # only the weight is left
    assert groups["default"]["lr"] == 0.1 and len(groups["default"]["params"]) == 2  # the head


def test_group_lr_skips_frozen_parameters():
    model = TinyNet()
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    groups = param_groups(model, 0.1, {"head": 1e-2})
    assert sum(len(g["params"]) for g in groups) == 2


def test_group_lr_prefix_matching_nothing():
    with pytest.raises(NameError_) as err:
        param_groups(TinyNet(), 0.1, {"neck": 1e-3})
    assert "optim.group_lr prefix 'neck' matches no parameter; top-level modules are: backbone, head" in str(err.value)


def test_no_trainable_parameters():
    model = TinyNet().requires_grad_(False)
    with pytest.raises(NameError_) as err:
        build_optimizer("sgd", model, 0.1)
    assert str(err.value) == ("the model has no trainable parameters (all requires_grad=False); unfreeze some "
                              "with p.requires_grad_(True), or pass an optimizer built on the parameters to train")


def test_group_lr_through_trainer_and_config(make_trainer, data):
    trainer = make_trainer(optimizer="sgd", lr=0.05, group_lr={"backbone": 1e-4, "head": 1e-2})
    lrs = {g["name"]: g["lr"] for g in trainer.optimizers["default"].param_groups}
    assert lrs == {"backbone": 1e-4, "head": 1e-2}
    trainer.fit(data)
    trainer2 = make_trainer(**{"optim.group_lr.backbone": "1e-4", "optim.group_lr.head": "1e-2"})
    assert {g["name"]: g["lr"] for g in trainer2.optimizers["default"].param_groups} == lrs


# ----------------------------------------------------------------------------- losses


def _logits_and_targets(n=12, c=5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)


def test_cross_entropy_with_label_smoothing():
    out, y = _logits_and_targets()
    assert torch.allclose(build_loss("cross_entropy")(out, y), F.cross_entropy(out, y))
    smooth = build_loss("cross_entropy", label_smoothing=0.1)(out, y)
    assert torch.allclose(smooth, F.cross_entropy(out, y, label_smoothing=0.1))
    assert not torch.allclose(smooth, F.cross_entropy(out, y))


def test_nll():
    out, y = _logits_and_targets()
    logp = out.log_softmax(1)
    assert torch.allclose(build_loss("nll")(logp, y), F.nll_loss(logp, y))


@pytest.mark.parametrize("name,fn", [("mse", F.mse_loss), ("l1", F.l1_loss), ("smooth_l1", F.smooth_l1_loss)])
def test_regression_losses_and_shape_forgiveness(name, fn):
    g = torch.Generator().manual_seed(2)
    out, y = torch.randn(10, 1, generator=g), torch.randn(10, generator=g)
    assert torch.allclose(build_loss(name)(out, y), fn(out.reshape(10), y))
    assert torch.allclose(build_loss(name)(out, y.view(10, 1)), fn(out, y.view(10, 1)))


def test_bce_with_logits_integer_targets():
    g = torch.Generator().manual_seed(3)
    out, y = torch.randn(10, 1, generator=g), torch.randint(0, 2, (10,), generator=g)
    assert torch.allclose(build_loss("bce_with_logits")(out, y),
                          F.binary_cross_entropy_with_logits(out.reshape(10), y.float()))


def test_callable_loss_is_used_as_is():
    fn = lambda o, t: (o - t).abs().sum()  # noqa: E731
    assert build_loss(fn) is fn


def test_unknown_loss_lists_valid_names(make_trainer):
    with pytest.raises(NameError_) as err:
        build_loss("crossentropy")
    assert "unknown loss 'crossentropy'; did you mean 'cross_entropy'? Valid names: cross_entropy, nll, mse, l1, " \
           "smooth_l1, bce_with_logits" in str(err.value)
    with pytest.raises(NameError_) as err:
        make_trainer(loss="hinge")
    assert str(err.value) == "unknown loss 'hinge'. Valid names: cross_entropy, nll, mse, l1, smooth_l1, bce_with_logits"
    with pytest.raises(NameError_) as err:
        build_loss(3)
    assert str(err.value) == "loss must be a name or a callable(output, target), got int"


def test_label_smoothing_through_trainer(make_trainer):
    trainer = make_trainer(loss="cross_entropy", label_smoothing=0.2)
    out, y = _logits_and_targets(c=4)
    assert torch.allclose(trainer.loss_fn(out, y), F.cross_entropy(out, y, label_smoothing=0.2))


def test_bce_training_through_trainer(make_trainer):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = (x[:, 0] > 0).long()
    trainer = make_trainer(TinyNet(classes=1), loss="bce_with_logits", metrics=["accuracy"], epochs=3, lr=0.5)
    trainer.fit(TensorDataset(x, y))
    res = trainer.evaluate(TensorDataset(x, y))
    with torch.no_grad():
        logits = trainer.model(x)
    # one logit per sample: the class is logit > 0, the loss is BCE against the float target
    assert res["accuracy"] == pytest.approx(float(((logits.view(-1) > 0).long() == y).float().mean()))
    assert res["accuracy"] > 0.7  # and it learned the rule
    assert res["loss"] == pytest.approx(float(F.binary_cross_entropy_with_logits(logits.view(-1), y.float())), rel=1e-6)
    assert torch.allclose(trainer.predict(x), torch.sigmoid(logits), atol=1e-6)  # predict: probabilities


# ----------------------------------------------------------------------------- schedulers


def _sgd(lr=0.1):
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=lr)


def _run(sched, opt, n):
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_step_divides_by_10_every_30_epochs():
    opt = _sgd()
    sched, interval = build_scheduler("step", opt, interval=None, total_steps=10_000, epochs=90)
    assert interval == "epoch"  # the ImageNet example's schedule counts epochs
    lrs = _run(sched, opt, 90)
    assert lrs[0] == lrs[29] == 0.1
    assert lrs[30] == pytest.approx(0.01) and lrs[59] == pytest.approx(0.01)
    assert lrs[60] == pytest.approx(0.001) and lrs[89] == pytest.approx(0.001)


def test_multistep_needs_and_uses_milestones():
    with pytest.raises(NameError_, match=r"scheduler 'multistep' needs scheduler.milestones, e.g. \[30, 60, 90\]"):
        build_scheduler("multistep", _sgd(), interval=None, total_steps=10, epochs=10)
    opt = _sgd()
    sched, interval = build_scheduler("multistep", opt, interval="step", total_steps=10, epochs=1,
                                      milestones=[2, 5], gamma=0.5)
    assert interval == "step"
    assert _run(sched, opt, 7) == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025])


def test_cosine_per_step_values():
    opt = _sgd()
    sched, interval = build_scheduler("cosine", opt, interval=None, total_steps=20, epochs=2, min_lr=0.0)
    assert interval == "step"
    lrs = _run(sched, opt, 20)
    expected = [0.1 * 0.5 * (1 + math.cos(math.pi * i / 20)) for i in range(20)]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_cosine_per_epoch_uses_epochs_as_horizon():
    opt = _sgd()
    sched, interval = build_scheduler("cosine", opt, interval="epoch", total_steps=1000, epochs=4, min_lr=0.02)
    assert interval == "epoch"
    lrs = _run(sched, opt, 4)
    expected = [0.02 + 0.08 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_onecycle_rises_then_falls():
    opt = _sgd()
    sched, interval = build_scheduler("onecycle", opt, interval=None, total_steps=20, epochs=2, pct_start=0.25)
    assert interval == "step"
    lrs = _run(sched, opt, 20)
    peak = max(range(20), key=lambda i: lrs[i])
    assert lrs[peak] == pytest.approx(0.1)
    assert peak == 4  # pct_start * total_steps - 1
    # torch's OneCycleLR shape: from max_lr / 25 up to max_lr, then down to max_lr / 25 / 1e4 at the last step
    assert lrs[0] == pytest.approx(0.1 / 25) and lrs[-1] == pytest.approx(0.1 / 25 / 1e4)


def test_warmup_cosine_values():
    opt = _sgd()
    sched, interval = build_scheduler("warmup_cosine", opt, interval=None, total_steps=20, epochs=2,
                                      warmup_steps=5, min_lr=0.01)
    assert interval == "step"
    lrs = _run(sched, opt, 20)
    assert lrs[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1])
    expected = [0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * (i - 5) / 15)) for i in range(5, 20)]
    assert lrs[5:] == pytest.approx(expected)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_warmup_cosine_keeps_group_ratios():
    m = TinyNet()
    opt = torch.optim.SGD(param_groups(m, 0.1, {"backbone": 0.01}), lr=0.1)
    sched, _ = build_scheduler("warmup_cosine", opt, interval="step", total_steps=10, epochs=1, warmup_steps=2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.005, 0.05])


@pytest.mark.parametrize("name", [None, "none", "None"])
def test_no_scheduler(name):
    assert build_scheduler(name, _sgd(), interval=None, total_steps=1, epochs=1) == (None, "step")


def test_unknown_scheduler_and_interval():
    with pytest.raises(NameError_) as err:
        build_scheduler("cosinee", _sgd(), interval=None, total_steps=1, epochs=1)
    assert "unknown scheduler 'cosinee'; did you mean 'cosine'? Valid names: none, step, multistep, cosine, " \
           "onecycle, warmup_cosine" in str(err.value)
    with pytest.raises(NameError_, match="scheduler.interval must be 'step' or 'epoch', got 'batch'"):
        build_scheduler("cosine", _sgd(), interval="batch", total_steps=1, epochs=1)


def _lr_rows(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "samples_per_s" in r]


def test_trainer_cosine_per_step_lr(make_trainer, data, run_dir):
    # 40 samples, batch 8, accumulate 2 -> windows of 2, 2, 1 -> 3 optimizer steps per epoch; 2 epochs.
    trainer = make_trainer(scheduler="cosine", epochs=2, accumulate=2, log_every=1, lr=0.1)
    trainer.fit(data)
    rows = _lr_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # the logged lr is the one in force for the next step
    expected = [0.1 * 0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(1, 7)]
    assert [r["lr"] for r in rows] == pytest.approx(expected, abs=1e-12)


def test_trainer_step_scheduler_per_epoch(make_trainer, data, run_dir):
    trainer = make_trainer(scheduler="step", epochs=5, log_every=1, lr=0.1,
                           **{"scheduler.step_size": 2, "scheduler.gamma": 0.1})
    assert trainer.cfg.scheduler.interval is None
    trainer.fit(data)
    assert trainer.sched_interval == "epoch"
    rows = _lr_rows(run_dir)
    for r in rows:  # the lr used during epoch e (1-based, as printed)
        assert r["lr"] == pytest.approx(0.1 * 0.1 ** ((r["epoch"] - 1) // 2))
    assert [h["lr"] for h in trainer.history] == pytest.approx([0.1, 0.01, 0.01, 1e-3, 1e-3])


def test_trainer_step_scheduler_per_step(make_trainer, data, run_dir):
    trainer = make_trainer(scheduler="step", scheduler_interval="step", epochs=2, log_every=1, lr=0.1,
                           **{"scheduler.step_size": 3, "scheduler.gamma": 0.5})
    trainer.fit(data)
    rows = _lr_rows(run_dir)
    assert [r["lr"] for r in rows] == pytest.approx([0.1 * 0.5 ** (k // 3) for k in range(1, 11)])


@pytest.mark.parametrize("extra", [{}, {"max_steps": 4}, {"accumulate": 3}])
def test_trainer_onecycle_runs_to_the_end(make_trainer, data, extra):
    trainer = make_trainer(scheduler="onecycle", epochs=2, **extra)
    trainer.fit(data)  # OneCycleLR raises if stepped more than total_steps times
    assert trainer.schedulers["default"].last_epoch == trainer.global_step


def test_trainer_warmup_cosine(make_trainer, data, run_dir):
    trainer = make_trainer(scheduler="warmup_cosine", warmup_steps=3, epochs=2, log_every=1, lr=0.1)
    trainer.fit(data)
    lrs = [r["lr"] for r in _lr_rows(run_dir)]
    assert lrs[:4] == pytest.approx([0.1 * 2 / 3, 0.1, 0.1, 0.1 * 0.5 * (1 + math.cos(math.pi * 1 / 7))])
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)


def test_trainer_user_scheduler_per_epoch(make_trainer, data):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = make_trainer(model, optimizer=opt, scheduler=sched, scheduler_interval="epoch", epochs=3)
    trainer.fit(data)
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.0125)


def test_trainer_unknown_scheduler(make_trainer, data):
    trainer = make_trainer(scheduler="cosin")
    with pytest.raises(NameError_, match="unknown scheduler 'cosin'; did you mean 'cosine'"):
        trainer.fit(data)


# ----------------------------------------------------------------------------- scheduler objects you pass in


def _with_scheduler(make_trainer, make_sched, epochs=2, **kw):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = make_sched(opt)
    trainer = make_trainer(model, optimizer=opt, scheduler=sched, epochs=epochs, **kw)
    return trainer, opt, sched


def test_a_steplr_object_is_stepped_per_epoch(make_trainer, data, capsys):
    """StepLR(step_size=1) is an epoch schedule: after 2 epochs the lr is 0.1 * 0.1**2, not 1e-11."""
    trainer, opt, sched = _with_scheduler(make_trainer, lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.1))
    trainer.fit(data)  # 5 optimizer steps per epoch
    assert trainer.sched_interval == "epoch" and sched.last_epoch == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** 2)
    assert "torchrig: scheduler" not in capsys.readouterr().err  # nothing ambiguous to say


@pytest.mark.parametrize("cls,interval", [("MultiStepLR", "epoch"), ("ExponentialLR", "epoch"),
                                          ("OneCycleLR", "step"), ("CyclicLR", "step")])
def test_scheduler_classes_imply_their_interval(make_trainer, data, cls, interval):
    S = torch.optim.lr_scheduler
    makers = {"MultiStepLR": lambda o: S.MultiStepLR(o, [1]), "ExponentialLR": lambda o: S.ExponentialLR(o, 0.9),
              "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=10),
              "CyclicLR": lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=2)}
    trainer, _, sched = _with_scheduler(make_trainer, makers[cls])
    trainer.fit(data)
    assert trainer.sched_interval == interval
    assert sched.last_epoch == (2 if interval == "epoch" else 10)  # 2 epochs of 5 optimizer steps


def test_reduce_lr_on_plateau_steps_on_the_monitored_value(make_trainer, data):
    """lr 0: the validation loss never improves, so after patience=1 bad epochs the lr is halved."""
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-12)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.5)
    trainer = make_trainer(model, optimizer=opt, scheduler=sched, epochs=3)
    trainer.fit(data, val_data=data)
    assert trainer.sched_interval == "epoch" and trainer.monitor.name == "val/accuracy"
    # mode min on a constant accuracy: epoch 1 sets the best, epochs 2 and 3 do not beat it by 50 %
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-12 * 0.5 ** 2)


def test_an_ambiguous_scheduler_says_which_interval_it_gets(make_trainer, data, capsys):
    trainer, _, sched = _with_scheduler(make_trainer, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0))
    trainer.fit(data)
    assert trainer.sched_interval == "step" and sched.last_epoch == 10
    assert ('torchrig: scheduler LambdaLR is stepped every optimizer step; to step it every epoch, set '
            'scheduler_interval="epoch" (config key scheduler.interval)') in capsys.readouterr().out
    trainer, _, sched = _with_scheduler(make_trainer, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0),
                                        scheduler_interval="epoch", overwrite=True)
    trainer.fit(data)
    assert trainer.sched_interval == "epoch" and sched.last_epoch == 2
