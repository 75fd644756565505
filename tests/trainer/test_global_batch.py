"""``data.global_batch_size``: the global batch is the user's number; the per-process batch and the accumulation
follow from the world size (and ``data.micro_batch_size``). The multi-process side (1, 2 and 3 processes of one
global batch giving the same parameters, and resuming across them) is in ``test_elastic.py``."""

from __future__ import annotations

import json

import pytest
import torch

from torchrig.config import ConfigError
from torchrig.data.split import split_global_batch


@pytest.mark.parametrize("world, micro, want", [
    (8, None, (4, 1)), (4, None, (8, 1)), (1, None, (32, 1)),   # 8 × 4, 4 × 8, one process loading 32
    (1, 4, (4, 8)), (2, 4, (4, 4)), (8, 4, (4, 1)),            # micro-batches of 4: accumulate the rest
    (2, "auto", (16, 1)),                                        # auto cuts the loaded share on out-of-memory
])
def test_the_global_batch_is_split_over_the_processes(world, micro, want):
    batch, accumulate = split_global_batch(32, world, micro)
    assert (batch, accumulate) == want
    assert batch * world * accumulate == 32


def test_a_global_batch_that_cannot_be_split_names_the_nearest_that_can():
    with pytest.raises(ConfigError) as err:
        split_global_batch(50, 3)
    assert str(err.value) == ("config key 'data.global_batch_size': 50 cannot be split evenly over 3 process(es) (it "
                              "must be a multiple of 3); the nearest that can: 48 and 51; or keep 50 on 2 or 5 processes")
    with pytest.raises(ConfigError) as err:
        split_global_batch(20, 2, 4)
    assert str(err.value) == ("config key 'data.global_batch_size': 20 cannot be split evenly over 2 process(es) × "
                              "micro-batches of 4 (it must be a multiple of 8); the nearest that can: 16 and 24; or "
                              "keep 20 on 1 or 5 processes; or change data.micro_batch_size")
    with pytest.raises(ConfigError, match="the nearest that can: 8; or keep 5 on 5 processes$"):
        split_global_batch(5, 8)
    with pytest.raises(ConfigError) as err:  # a 2-process checkpoint's global batch 16, resumed on 3
        split_global_batch(16, 3)
    assert str(err.value).endswith("the nearest that can: 15 and 18; or keep 16 on 2 or 4 processes")


def test_one_process_accumulating_micro_batches_equals_one_batch(make_trainer, data, capfd, restore_threads):
    """global_batch_size 16 with micro-batches of 4 in one process: 4 loaded batches per step, the same parameters
    as one batch of 16; the start line says how the global batch was split."""
    whole = make_trainer(batch_size=16, epochs=2)
    whole.fit(data)
    split = make_trainer(global_batch_size=16, micro_batch_size=4, epochs=2, overwrite=True)
    split.fit(data)
    said = "".join(capfd.readouterr())
    assert "batch 4/process × 1 × 4 accumulation = 16 global (data.global_batch_size)" in said
    assert (split.plan.batch_size, split.plan.accumulate) == (4, 4)  # derived: the run plan's
    assert (split.cfg.data.batch_size, split.cfg.accumulate) == (8, 1)  # the config stays as validated (defaults)
    meta = json.loads((split.run_dir / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["plan"] == {"batch_size": 4, "accumulate": 4, "dp_size": 1, "world_size": 1}
    assert split.global_step == whole.global_step
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


class _StopAt:
    """Stops a fit right after the checkpoint of optimizer step ``step`` (as a killed process would)."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, trainer, path, metrics):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def test_a_step_schedule_keeps_its_horizon_when_the_steps_per_epoch_change(make_trainer, data, capfd,
                                                                          restore_threads):
    """A one-cycle schedule planned for 4 epochs of batch 16 (the checkpoint's run), resumed mid-epoch with batch 8
    (forced with resume_changes=allow): torch's OneCycleLR would raise past its total steps; the run keeps the
    horizon its checkpoint planned and says so in one line."""
    first = make_trainer(batch_size=16, epochs=4, scheduler="onecycle", checkpoint_every=1,
                         callbacks=[_StopAt(5)])
    with pytest.raises(KeyboardInterrupt):
        first.fit(data)
    first.close()
    planned = first.state.total_steps
    assert first.global_step == 5 and planned == 12 and first.state.batch_in_epoch == 2  # 40 samples: 3 steps/epoch
    resumed = make_trainer(batch_size=8, epochs=4, scheduler="onecycle", resume="latest", resume_changes="allow")
    resumed.fit(data)
    said = "".join(capfd.readouterr())
    assert resumed.global_step == planned
    sched = resumed.schedulers["default"]
    assert sched.total_steps == sched.last_epoch == planned
    steps_per_epoch = -(-len(data) // 8)
    assert (f"torchrig: the run keeps the length its checkpoint planned, {planned} optimizer steps (this run's "
            f"{steps_per_epoch} steps per epoch alone would make it {4 * steps_per_epoch}), so that step-based "
            f"schedules keep their horizon") in said
