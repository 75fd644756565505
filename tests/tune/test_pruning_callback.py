"""The pruning callback of a trial: the study's pruner is asked after each epoch but the last (after the last one
pruning saves nothing: the trial completes with its value), and its answer stops every rank alike."""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")

from torchrig.tune.trial import PruningCallback, Pruned  # noqa: E402


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_pruner_is_not_asked_after_the_last_epoch(make_trainer, data, epochs):
    """A pruner that prunes every value (a threshold below any loss): a one-epoch trial completes, reporting its
    epoch; a two-epoch trial is pruned after its first."""
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0))
    trial = study.ask()
    callback = PruningCallback(trial, "val/loss")
    trainer = make_trainer(epochs=epochs, callbacks=[callback])
    if epochs == 1:
        trainer.fit(data, data)
    else:
        with pytest.raises(Pruned) as stop:
            trainer.fit(data, data)
        assert (stop.value.epoch, stop.value.value) == (1, callback.values[1])
    assert trainer.epoch == 1 and list(callback.values) == [1] and callback.values[1] > 0
    assert study.trials[0].intermediate_values == {1: callback.values[1]}
