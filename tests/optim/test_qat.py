"""Quantisation-aware training through torchao (``quantize.qat``): fake-quantised training, then ``torchrig export
--quantize`` converts, its outputs equal to the fake-quantised model's within torchao's tolerance."""

from __future__ import annotations

import pytest
import torch
from helpers import QUIET, make_classification
from torch import nn

import torchrig
from torchrig.config import ConfigError

pytest.importorskip("torchao")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4), nn.Linear(4, 4))


@pytest.mark.parametrize("scheme", ["int8-dynamic-act-int4-weight", "int4-weight-only"])
def test_fake_quantised_training_then_convert_within_torchaos_tolerance(tmp_path, capsys, scheme):
    from torchao.quantization.qat import FakeQuantizedLinear

    from torchrig.optim import qat

    model = mlp()
    ids = [id(p) for p in model.parameters()]
    x, y = make_classification(n=32, features=32)
    trainer = torchrig.Trainer(model, qat=scheme, max_steps=4, batch_size=8, run_dir=str(tmp_path), **QUIET)
    trainer.fit((x, y))
    assert "".join(capsys.readouterr()).count(f"torchrig: quantisation-aware training (torchao {scheme}, groups of 32) "
                                              f"on 2 Linear layers; 1 left in float (in_features not a multiple of "
                                              f"32: 3)") == 1
    assert [type(m) for m in model] == [FakeQuantizedLinear, nn.ReLU, FakeQuantizedLinear, nn.Linear]
    assert [id(p) for p in model.parameters()] == ids  # the optimizer's parameters, under the same names
    model.eval()
    with torch.no_grad():
        fake = model(x)
        qat.convert(model, trainer.cfg.quantize)
        real = model(x)
    assert type(model[0].weight).__name__ == "IntxUnpackedToInt8Tensor"
    # torchao's tests hold these schemes to SQNR inf (identical outputs) between fake-quantised and converted
    assert (fake - real).abs().max() <= 1e-5


def test_a_group_size_that_divides_no_layer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"'quantize.group_size': 48 divides the in_features of none of Sequential's "
                                          r"Linear layers"):
        torchrig.Trainer(mlp(), qat="int4-weight-only", **{"quantize.group_size": 48}, run_dir=str(tmp_path), **QUIET)


def test_export_quantize_converts_a_qat_checkpoint(tmp_path, capsys):
    from helpers.recipe_helpers import cli, sets

    run = tmp_path / "run"
    assert cli(["train", *sets("model.name=mlp", "quantize.qat=int8-dynamic-act-int4-weight", "max_steps=3",
                               "data.batch_size=16", f"run_dir={run}")])[0] == 0
    out = tmp_path / "model.pt2"
    rc, stdout, stderr = cli(["export", "--checkpoint", str(run), "--format", "torch-export", "--quantize",
                              "--output", str(out)], capsys)
    assert rc == 0, stderr
    assert "quantised: max |difference| 0.00e+00 from the fake-quantised model (torchao " \
           "int8-dynamic-act-int4-weight)" in stdout
    program = torch.export.load(str(out)).module()
    assert any("quantize" in str(n.target) or "int8" in str(n.target) for n in program.graph.nodes)
    rc, _, stderr = cli(["export", "--checkpoint", str(run), "--format", "onnx", "--quantize"], capsys)
    assert rc == 1 and "torchao's quantised tensors are written by torch.export only" in stderr


def test_importing_torchao_after_torchrig_prints_nothing():
    """torchao's import (by transformers and peft too) logs torch's deprecation of its enum registrations: noise on
    stderr above a run's first line, which torchrig drops."""
    import subprocess
    import sys

    from helpers import subprocess_env

    done = subprocess.run([sys.executable, "-c", "import torchrig.runtime, torchao.quantization"], capture_output=True,
                          text=True, timeout=120, env=subprocess_env())
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
