"""The README's Python examples run as written: every ```python block, in order, in one namespace (a
block may use what an earlier one defined), in a temporary directory. Bash blocks are not run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, source) of every ```python block of README.md."""
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


pytestmark = pytest.mark.usefixtures("restore_threads")


def test_readme_has_the_examples():
    blocks = python_blocks()
    assert len(blocks) >= 4
    assert any("step.frozen" in src for _, src in blocks)  # the GAN example keeps G's gradient out of D


def test_every_python_block_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # run_dir="runs/..." lands here
    monkeypatch.setattr("sys.path", [str(tmp_path)] + __import__("sys").path)
    namespace: dict = {"__name__": "readme"}
    for line, src in python_blocks():
        code = compile(src, f"README.md, block at line {line}", "exec")
        exec(code, namespace)  # a failure names the block's line in the traceback
    trainer = namespace["trainer"]
    assert trainer.global_step == 16 and trainer.history  # the GAN example: 2 epochs of 8 batches
    assert {"d_loss", "g_loss"} <= {k.split("/")[-1] for row in trainer.history for k in row}
    assert namespace["probs"].shape == (64, 10)  # the Python API example predicted its new data
    torch.testing.assert_close(namespace["probs"].sum(1), torch.ones(64))
    assert (tmp_path / "runs" / "exp1" / "checkpoints" / "latest").exists()
    assert namespace["next_token"].shape == (4, 16, 32)  # the token model: softmax over its classes, the last dim
    torch.testing.assert_close(namespace["next_token"].sum(-1), torch.ones(4, 16))
    cfg = namespace["torchrig"].Config()
    model, data = namespace["build_model"](cfg), namespace["build_data"](cfg)
    assert model(data[2][0]).shape == (100, 3)  # the command-line factories build what they promise
    torch.testing.assert_close(namespace["build_data"](cfg)[2][0], data[2][0])  # the same data when rebuilt


def test_ci_runs_the_readme_test_command():
    """.ci/run runs what the README tells a developer to run (its install and pytest command), plus
    ``--durations=30``, with ``CI=true`` exported so that the two-machine test runs instead of skipping."""
    text = README.read_text()
    block = text[text.index("**Run the tests:**"):]
    block = block[block.index("```bash\n") + 8:]
    command = block[:block.index("\n```")].strip()
    *install, pytest_cmd = [part.strip() for part in command.split("&&")]
    ci = [line.strip() for line in (README.parent / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert "export CI=true" in ci
    assert ci[-1] == f"{pytest_cmd} --durations=30"
    pip = next(p for p in install if p.startswith("pip install"))
    assert f"python -m {pip.replace('pip install', 'pip install --quiet')}" in ci
