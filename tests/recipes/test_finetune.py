"""Recipe ``finetune``: LoRA on a GPT-2 built from its config trains and evaluates on the CPU; its checkpoint of
adapters is evaluated, predicted with and exported (merged, or the adapter folder) against the adapted model."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.recipe_helpers import cli, sets

pytest.importorskip("peft")
pytest.importorskip("transformers")

WORDS = ["the", "model", "reads", "a", "file", "and", "writes", "json", "objects", "to", "disk", "each", "line"]
TINY = ["model.options={n_layer: 2, n_embd: 32, n_head: 2}", "lm.block_size=8", "lm.vocab_size=200",
        "lm.min_frequency=1", "data.batch_size=4", "epochs=1", "data.val_fraction=0.2"]


def corpus(path, n: int = 40):
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (10,), generator=g).tolist()) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``torchrig train --recipe finetune`` on a small text file, with a test split (it evaluates at the end)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("finetune")
    text = corpus(root / "train.txt")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc, _, _ = cli(["train", "--recipe", "finetune", *sets(f"data.path={text}", f"data.test_path={text}", *TINY,
                                                               f"run_dir={root / 'run'}")])
    assert rc == 0
    (root / "printed.txt").write_text(printed.getvalue())
    return root / "run"


def test_the_recipe_trains_lora_and_evaluates_on_the_cpu(run, capsys):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["epoch"] and rows[0]["val/loss"] > 0  # validated at the epoch's end
    assert (run.parent / "printed.txt").read_text().startswith("test: loss ")  # and evaluated on the test split
    meta = json.loads((run / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["weights"] == "trainable" and meta["base"]["class"].endswith(":GPT2LMHeadModel")
    rc, out, err = cli(["evaluate", "--checkpoint", run], capsys)
    assert rc == 0 and "loss:" in out, err
    rc, _, err = cli(["evaluate", "--checkpoint", run, "--set", "seed=1"], capsys)  # another seed: another base
    assert rc == 1 and "holds adapters trained on another base model: GPT2LMHeadModel sha256" in err
    assert len(err.strip().splitlines()) == 1


def test_merged_exports_equal_the_adapted_model(run, tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from torchrig.export import example_inputs
    from torchrig.recipes.run import load_for_inference

    recipe, cfg, adapted, _ = load_for_inference(str(run))
    args, kwargs = example_inputs(recipe, cfg, adapted.eval())
    with torch.inference_mode():
        want = adapted(*args, **kwargs).logits
    rc, out, err = cli(["export", "--checkpoint", run, "--format", "hf", "--merge", "--output", tmp_path / "hf"], capsys)
    assert rc == 0 and "merged: max |difference|" in out, err
    merged = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.inference_mode():
        assert (merged(*args, **kwargs).logits - want).abs().max() <= 1e-5
    rc, out, err = cli(["export", "--checkpoint", run, "--format", "safetensors", "--merge", "--output",
                        tmp_path / "merged.safetensors"], capsys)
    assert rc == 0, err


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations, met inside peft
def test_the_adapter_folder_loads_onto_its_base_with_peft(run, tmp_path, capsys):
    from peft import PeftModel

    from torchrig.export import example_inputs
    from torchrig.recipes import get_recipe
    from torchrig.recipes.run import base_model, load_checkpoint_model

    got = load_checkpoint_model(str(run))
    args, kwargs = example_inputs(got.recipe, got.cfg, got.model.eval())
    with torch.inference_mode():
        want = got.model(*args, **kwargs).logits
    rc, _, err = cli(["export", "--checkpoint", run, "--format", "adapter", "--output", tmp_path / "lora"], capsys)
    assert rc == 0, err
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "lora").iterdir()}
    loaded = PeftModel.from_pretrained(base_model(get_recipe("finetune"), got.cfg, got.meta), tmp_path / "lora").eval()
    with torch.inference_mode():
        assert (loaded(*args, **kwargs).logits - want).abs().max() <= 1e-5
    rc, _, err = cli(["export", "--checkpoint", run, "--format", "hf"], capsys)
    assert rc == 1 and "holds peft adapters; add --merge" in err


def test_classification_trains_the_head_in_full_beside_the_adapters(tmp_path, capsys):
    rows = ["text,label"] + [f"{' '.join(WORDS[(i + j) % len(WORDS)] for j in range(6))},{'ab'[i % 2]}"
                             for i in range(24)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    rc, _, err = cli(["train", "--recipe", "finetune", *sets(
        "finetune.task=classification", f"data.path={tmp_path / 'train.csv'}", "text.max_length=12",
        "text.vocab_size=100", "text.min_frequency=1", "model.options={n_layer: 1, n_embd: 16, n_head: 2}",
        "metrics=[accuracy]", "epochs=1", "data.batch_size=4", "data.val_fraction=0.25",
        f"run_dir={tmp_path / 'run'}")], capsys)
    assert rc == 0, err
    assert "the classifier head 'score' trains in full (peft.modules_to_save)" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/accuracy" in r for r in rows)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "run" / "checkpoints" / "latest" / "model.safetensors")
    assert {k for k in saved if "score" in k} == {"score.modules_to_save.default.weight"}


def test_a_local_model_folder_as_the_base(run, tmp_path, capsys):
    """A Hugging Face folder (here: the merged export of a finetune run, with its tokenizer) fine-tuned again, its
    tokenizer taking the data; its checkpoint evaluates against that folder's weights."""
    base = tmp_path / "base"
    assert cli(["export", "--checkpoint", run, "--format", "hf", "--merge", "--output", base], capsys)[0] == 0
    text = corpus(tmp_path / "train.txt")
    rc, _, err = cli(["train", "--recipe", "finetune", *sets(f"finetune.base={base}", f"data.path={text}",
                                                             f"data.test_path={text}", *TINY,
                                                             f"run_dir={tmp_path / 'again'}")], capsys)
    assert "Loading weights" not in err
    assert rc == 0, err
    meta = json.loads((tmp_path / "again" / "checkpoints" / "latest" / "meta.json").read_text())
    from safetensors.torch import load_file

    merged = load_file(base / "model.safetensors")
    assert meta["base"]["parameters"] == sum(t.numel() for t in merged.values())
    rc, out, err = cli(["evaluate", "--checkpoint", tmp_path / "again"], capsys)
    assert rc == 0 and "loss:" in out, err
