"""``torchrig predict`` on a model whose output is a dict: the prediction field, processed as for a tensor
output (class probabilities in CSV / JSON), by default; ``--all-outputs`` writes every per-sample field."""

from __future__ import annotations

import csv
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from torchrig.cli import main

from helpers import UserProject, one_line_error

QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none"]
PKG = "rigpredictoutputs"  # a package name no other test uses

TASK = '''
import torch
from torch import nn


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        f = torch.tanh(self.body(x))
        return {"features": f, "logits": self.head(f)}


def build_model(cfg):
    torch.manual_seed(0)
    return DictNet()


def build_data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return (x[:32], y[:32]), (x[32:], y[32:])
'''


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    project = UserProject(tmp_path_factory.mktemp("project"), PKG, TASK)
    root, run = project.root, project.root / "run"
    assert main(["train", "--model", f"{PKG}.task:build_model", "--data", f"{PKG}.task:build_data", *QUICK,
                 "--set", "epochs=1", "--set", f"run_dir={run}"]) == 0
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    np.save(root / "x.npy", x.numpy())
    from safetensors.torch import load_file as load

    model = sys.modules[f"{PKG}.task"].DictNet()
    model.load_state_dict(load(str(run / "checkpoints" / "latest" / "model.safetensors")))
    with torch.no_grad():
        expected = model(x)
    yield root, run, expected
    project.close()


def test_predict_writes_the_prediction_field_as_probabilities(trained):
    root, run, expected = trained
    assert main(["predict", "--checkpoint", str(run), "--input", "x.npy", "--output", "p.csv", "--topk", "3"]) == 0
    with open(root / "p.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    probs = expected["logits"].softmax(-1)
    assert [int(r["prediction"]) for r in rows] == probs.argmax(1).tolist()
    assert [float(r["probability"]) for r in rows] == pytest.approx(probs.max(1).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_all_outputs_writes_every_field(trained, suffix):
    root, run, expected = trained
    out = root / f"all{suffix}"
    assert main(["predict", "--checkpoint", str(run), "--input", "x.npy", "--output", str(out), "--all-outputs"]) == 0
    got = {k: torch.from_numpy(v) for k, v in np.load(out).items()} if suffix == ".npz" else load_file(str(out))
    assert set(got) == {"features", "logits"}
    torch.testing.assert_close(got["logits"], expected["logits"].softmax(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["features"], expected["features"], atol=1e-6, rtol=1e-5)


def test_all_outputs_to_another_kind_of_file_is_refused(trained, capsys):
    root, run, _ = trained
    assert one_line_error(capsys, ["predict", "--checkpoint", str(run), "--input", "x.npy", "--output", "all.csv",
                                   "--all-outputs"]) == (
        "torchrig: error: predict --all-outputs --output 'all.csv': the whole output is written field by field as "
        ".npz (numpy) or .safetensors; name the file e.g. predictions.npz")
    assert not (root / "all.csv").exists()
