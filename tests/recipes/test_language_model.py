"""Recipe ``language-model``: a GPT-2 from a config trained under ``parallel.pp=2`` from the command line, its
checkpoint evaluated and used for prediction in one process."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from helpers.recipe_helpers import cli, ddp_train, max_param_diff, one_process_train, sets

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

WORDS = ["the", "model", "reads", "a", "file", "and", "writes", "json", "objects", "to", "disk", "each", "line"]
TINY = ["model.options={n_layer: 2, n_embd: 16, n_head: 2}", "lm.block_size=8", "lm.vocab_size=200",
        "lm.min_frequency=1", "data.batch_size=4", "accumulate=2", "max_steps=3", "data.val_fraction=0"]


def corpus(path, n: int = 60):
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (12,), generator=g).tolist()) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_gpt2_trains_under_a_two_stage_pipeline_and_its_checkpoint_serves_one_process(tmp_path, capsys):
    """``torchrig train --recipe language-model --set parallel.pp=2`` on two processes: the stages hold the two
    halves of the model (embeddings with the first blocks, the head with the last) and together end where one
    process ends (1e-6); ``torchrig evaluate`` and ``predict`` then read the checkpoint in one process."""
    text = corpus(tmp_path / "train.txt")
    args = ["train", "--recipe", "language-model"] + sets(f"data.path={text}", f"data.test_path={text}", *TINY)
    p0, p1 = ddp_train(tmp_path, args + sets(f"run_dir={tmp_path / 'pp'}", "parallel.pp=2"))
    assert any(k.startswith("transformer.wte") for k in p0) and not any(k.startswith("lm_head") for k in p0)
    assert any(k.startswith("lm_head") for k in p1) and not any(k.startswith("transformer.wte") for k in p1)
    one = one_process_train(args + sets(f"run_dir={tmp_path / 'one'}"), tmp_path / "one")
    assert max_param_diff({**p0, **p1}, one) < 1e-6
    checkpoint = tmp_path / "pp" / "checkpoints" / "latest"
    rc, out, err = cli(["evaluate", "--checkpoint", checkpoint], capsys)
    assert rc == 0 and "loss:" in out, err
    (tmp_path / "prompts.txt").write_text("the model reads\njson objects to\n")
    rc, _, err = cli(["predict", "--checkpoint", checkpoint, "--input", tmp_path / "prompts.txt", "--output",
                      tmp_path / "next.json", "--topk", "3"], capsys)
    rows = json.loads((tmp_path / "next.json").read_text())
    assert rc == 0 and [r["input"] for r in rows] == ["prompts.txt:1", "prompts.txt:2"], err
    assert all(len(r["top"]) == 3 and r["top"][0]["class"] == r["prediction"] and isinstance(r["prediction"], str)
               and r["top"][0]["probability"] >= r["top"][1]["probability"] for r in rows)


def test_packed_documents_train_gpt2_and_the_start_line_says_how_full_the_rows_are(tmp_path, capsys):
    """``data.pack=true``: documents of 4 … 40 words packed into rows of lm.block_size tokens (GPT-2 keeps them
    apart by their position ids); the start line gives the share of tokens used."""
    g = torch.Generator().manual_seed(1)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(n),), generator=g).tolist())
             for n in torch.randint(4, 41, (80,), generator=g)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    args = ["train", "--recipe", "language-model"] + sets(f"data.path={tmp_path / 'train.txt'}", *TINY,
                                                          "lm.block_size=32", "data.pack=true",
                                                          f"run_dir={tmp_path / 'run'}")
    rc, out, err = cli(args, capsys)
    assert rc == 0, err
    said = next(line for line in (out + err).splitlines() if "language-model data:" in line)
    assert "torchrig: language-model data: train packed 80 documents" in said, said
    used = float(said.split(" % of tokens used")[0].rsplit(": ", 1)[-1])
    assert used >= 95.0, said
    assert "torchrig: done · 3 steps" in out + err
