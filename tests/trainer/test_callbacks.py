"""Callbacks: plain objects whose hooks fire at fixed points of the loop; stateful ones are checkpointed."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import torchrig
from helpers import QUIET, TinyNet, make_classification
from torchrig.config import ConfigError
from torchrig.trainer import default_step


class Recorder:
    def __init__(self):
        self.calls = []

    def on_fit_start(self, trainer):
        self.calls.append(("fit_start", trainer.global_step))

    def on_step_end(self, trainer, outputs):
        self.calls.append(("step_end", trainer.global_step, sorted(outputs)))

    def on_log(self, trainer, values, kind):
        self.calls.append(("log", kind, trainer.global_step))

    def on_eval_end(self, trainer, metrics):
        self.calls.append(("eval_end", sorted(metrics)))

    def on_save(self, trainer, path, metrics):
        self.calls.append(("save", path.name))

    def on_fit_end(self, trainer):
        self.calls.append(("fit_end", trainer.global_step))


def _trainer(run_dir, callbacks, **kw):
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=10, epochs=2, optimizer="sgd", lr=0.05, num_workers=0,
                shuffle=False, log_every=2, checkpoint_every_epochs=1)
    opts.update(kw)
    return torchrig.Trainer(TinyNet(dropout=0.2), callbacks=callbacks, **opts)


def test_hooks_fire_at_fixed_points_in_order(tmp_path):
    rec = Recorder()
    x, y = make_classification(40)
    _trainer(tmp_path / "run", [rec]).fit(TensorDataset(x, y), val_data=TensorDataset(x[:10], y[:10]))
    def epoch(first_step):  # 4 optimizer steps of 10 samples, a log row every 2 steps
        s = first_step
        return [("step_end", s, ["loss"]), ("step_end", s + 1, ["loss"]), ("log", "interval", s + 1),
                ("step_end", s + 2, ["loss"]), ("step_end", s + 3, ["loss"]), ("log", "interval", s + 3),
                ("eval_end", ["accuracy", "loss"]), ("log", "epoch", s + 3), ("save", f"step-{s + 3:08d}")]

    assert rec.calls == [("fit_start", 0)] + epoch(1) + epoch(5) + [("fit_end", 8)]


def test_on_exception_sees_the_error_and_it_is_raised(tmp_path):
    seen = []

    class Watch:
        def on_exception(self, trainer, exc):
            seen.append((type(exc).__name__, str(exc), trainer.global_step))

    def failing_step(step, batch):
        if step.global_step == 3:
            raise RuntimeError("boom in step 4")
        return default_step(step, batch)

    x, y = make_classification(40)
    trainer = _trainer(tmp_path / "run", [Watch()], step_fn=failing_step)
    with pytest.raises(RuntimeError, match="boom in step 4"):
        trainer.fit(TensorDataset(x, y))
    assert seen == [("RuntimeError", "boom in step 4", 3)]


class LossSum:
    """A stateful callback: the running sum of every step's loss, and the number of steps it saw."""

    def __init__(self):
        self.total, self.steps = torch.zeros((), dtype=torch.float64), 0

    def on_step_end(self, trainer, outputs):
        self.total += outputs["loss"].double()
        self.steps += 1

    def state_dict(self):
        return {"total": self.total.clone(), "steps": self.steps}

    def load_state_dict(self, state):
        self.total, self.steps = state["total"].clone(), state["steps"]


class Interrupt(Exception):
    pass


def test_stateful_callback_is_checkpointed_and_restored_exactly(tmp_path):
    x, y = make_classification(40)
    data = TensorDataset(x, y)
    full = LossSum()
    _trainer(tmp_path / "full", [full], epochs=3, checkpoint_every=5).fit(data)

    class StopAt:
        def on_save(self, trainer, path, metrics):
            if trainer.global_step == 5:
                raise Interrupt()

    first = LossSum()
    with pytest.raises(Interrupt):
        _trainer(tmp_path / "cut", [first, StopAt()], epochs=3, checkpoint_every=5).fit(data)
    assert first.steps == 5
    resumed = LossSum()
    # the same callbacks in the same order: the stand-in for StopAt keeps the position of the state
    _trainer(tmp_path / "cut", [resumed, object()], epochs=3, checkpoint_every=5, resume="latest").fit(data)
    assert resumed.steps == full.steps == 12
    assert torch.equal(resumed.total, full.total)  # bitwise: restored, then the same 7 steps added


def test_a_misspelled_hook_is_an_error(tmp_path):
    class Typo:
        def on_epoch_end(self, trainer):
            pass

    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path / "run", [Typo()])
    assert str(err.value) == ("callback method 'on_epoch_end' is not a hook; hooks are on_fit_start, on_step_end, "
                              "on_log, on_eval_end, on_save, on_fit_end, on_exception")


def test_early_stopping_and_best_checkpoint_are_callbacks(tmp_path):
    from torchrig.trainer.callbacks import BestCheckpoint, EarlyStopping

    def no_update(step, batch):  # the loss is computed and logged, the weights never change
        with torch.no_grad():
            return {"loss": step.loss_fn(step.model(batch[0]), batch[1])}

    x, y = make_classification(40)
    trainer = _trainer(tmp_path / "run", [], early_stop_patience=1, epochs=6, step_fn=no_update)
    trainer.fit(TensorDataset(x, y), val_data=TensorDataset(x, y))
    kinds = [type(cb) for cb in trainer._run_callbacks.items]
    assert kinds[:2] == [EarlyStopping, BestCheckpoint]
    assert trainer.state.epoch == 2 and trainer.early_stopping.bad_epochs == 1  # epoch 2 did not improve
