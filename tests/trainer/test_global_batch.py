"""``data.global_batch_size``: the global batch is the user's number; the per-process batch and the accumulation
follow from the world size (and ``data.micro_batch_size``). The multi-process side (1, 2 and 3 processes of one
global batch giving the same parameters, and resuming across them) is in ``test_elastic.py``."""

from __future__ import annotations

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
                              "must be a multiple of 3); the nearest that can: 48 and 51")
    with pytest.raises(ConfigError) as err:
        split_global_batch(20, 2, 4)
    assert str(err.value) == ("config key 'data.global_batch_size': 20 cannot be split evenly over 2 process(es) × "
                              "micro-batches of 4 (it must be a multiple of 8); the nearest that can: 16 and 24; or "
                              "change data.micro_batch_size")
    with pytest.raises(ConfigError, match="the nearest that can: 8$"):
        split_global_batch(5, 8)


def test_one_process_accumulating_micro_batches_equals_one_batch(make_trainer, data, capfd, restore_threads):
    """global_batch_size 16 with micro-batches of 4 in one process: 4 loaded batches per step, the same parameters
    as one batch of 16; the start line says how the global batch was split."""
    whole = make_trainer(batch_size=16, epochs=2)
    whole.fit(data)
    split = make_trainer(global_batch_size=16, micro_batch_size=4, epochs=2, overwrite=True)
    split.fit(data)
    said = "".join(capfd.readouterr())
    assert "batch 4/process × 1 × 4 accumulation = 16 global (data.global_batch_size)" in said
    assert (split.cfg.data.batch_size, split.cfg.accumulate) == (4, 4)
    assert split.global_step == whole.global_step
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
