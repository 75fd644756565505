"""pytest fixtures and hooks shared by every test folder; helpers to import are in ``tests/helpers``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import QUIET, TinyNet, make_classification
# a hung test fails by name within its time limit and takes the processes it started with it
from helpers.timeouts import (pytest_runtest_makereport, pytest_runtest_protocol,  # noqa: F401
                              pytest_timeout_set_timer)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped without one, run where a GPU is lent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def data():
    x, y = make_classification()
    return TensorDataset(x, y)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyNet()


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def make_trainer(run_dir):
    """``make_trainer(model, **kw)``: a quiet Trainer writing under tmp_path (keywords override)."""
    import torchrig

    def make(model=None, **kw):
        if model is None:
            torch.manual_seed(0)
            model = TinyNet()
        opts = dict(QUIET, run_dir=str(run_dir), batch_size=8, epochs=1, lr=0.05, optimizer="sgd", num_workers=0)
        opts.update(kw)
        return torchrig.Trainer(model, **opts)

    return make


@pytest.fixture
def restore_threads():
    """Code under test may call torch.set_num_threads (the ``threads`` key); put the count back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
