"""LoRA through peft (``peft.*``): only the adapters train, checkpoints hold what trains and the base's identity,
a resume is bitwise and refused on another base; the refusals each say why in one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QUIET, TinyNet, make_classification
from safetensors.torch import load_file

import torchrig
from torchrig.checkpoint import CheckpointError
from torchrig.config import ConfigError

pytest.importorskip("peft")
pytest.importorskip("transformers")

VOCAB, LENGTH = 50, 12


def gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer GPT-2 (n_embd 32) built from its config, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def tokens(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def settings(run_dir, **extra) -> dict:
    kw = dict(QUIET, peft="lora", lr=1e-2, batch_size=4, metrics=[], run_dir=str(run_dir), num_workers=0)
    kw.update(extra)
    return kw


def snapshot(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_only_the_adapters_train_and_the_base_is_bitwise_unchanged_after_20_steps(tmp_path, capsys):
    model = gpt2()
    base = snapshot(model)
    trainer = torchrig.Trainer(model, max_steps=20, **settings(tmp_path))
    trainer.fit(tokens())
    out = "".join(capsys.readouterr())
    assert "torchrig: LoRA r=8 on 8 modules: 8,192 of 37,248 parameters train" in out  # c_attn, c_proj, c_fc, mlp.c_proj
    assert "(8,192 trainable, 29,056" in out  # the summary: trainable vs frozen
    after = model.state_dict()
    renamed = {k.replace(".base_layer.", "."): v for k, v in after.items() if "lora_" not in k}
    assert renamed.keys() == base.keys() and all(torch.equal(renamed[k], base[k]) for k in base)
    adapters = {k: v for k, v in after.items() if "lora_B" in k}
    assert len(adapters) == 8 and all(v.abs().sum() > 0 for v in adapters.values())  # B starts at zero
    saved = load_file(tmp_path / "checkpoints" / "latest" / "model.safetensors")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and len(trainable) == 16
    meta = json.loads((tmp_path / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["weights"] == "trainable" and meta["base"]["parameters"] == 29_056
    assert meta["base"]["class"] == "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"
    assert meta["base"]["config"]["n_embd"] == 32 and len(meta["base"]["sha256"]) == 64


def test_plain_module_patterns_and_modules_trained_in_full(tmp_path):
    model = TinyNet()
    x, y = make_classification()
    trainer = torchrig.Trainer(model, max_steps=3, **settings(tmp_path, metrics=["accuracy"]),
                               **{"peft.target_modules": ["backbone.*"], "peft.modules_to_save": ["head"]})
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        "backbone.0.lora_A.default.weight", "backbone.0.lora_B.default.weight", "head.modules_to_save.default.bias",
        "head.modules_to_save.default.weight"]
    assert trainer.adapted.modules == 1 and trainer.adapted.trainable == 8 * 8 + 8 * 16 + 16 * 4 + 4
    trainer.fit((x, y))


def test_a_pattern_that_matches_nothing_names_the_nearest_modules(tmp_path):
    with pytest.raises(ConfigError) as e:
        torchrig.Trainer(gpt2(), **settings(tmp_path, **{"peft.target_modules": ["c_atn"]}))
    assert str(e.value).startswith("config key 'peft.target_modules': 'c_atn' matches no module of GPT2LMHeadModel; "
                                   "did you mean 'c_attn'")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"'backbone\.1', a ReLU; LoRA adapts Linear, Embedding"):
        torchrig.Trainer(TinyNet(), **settings(tmp_path, **{"peft.target_modules": ["backbone.1"]}))


def _train(run_dir, stop_after=None, model=None, **kw):
    model = model if model is not None else gpt2()
    trainer = torchrig.Trainer(model, **settings(run_dir, epochs=2, checkpoint_every=1, resume="latest", **kw))
    if stop_after is not None:
        real = trainer._save

        def save(metrics=None, final=False):
            path = real(metrics=metrics, final=final)
            if trainer.global_step == stop_after:
                raise KeyboardInterrupt
            return path

        trainer._save = save
    try:
        trainer.fit(tokens(26))  # 7 batches per epoch: step 4 is mid-epoch
    except KeyboardInterrupt:
        return None
    return snapshot(model), trainer


def test_mid_epoch_resume_of_a_lora_model_is_bitwise(tmp_path):
    whole, _ = _train(tmp_path / "whole")
    assert _train(tmp_path / "cut", stop_after=4) is None
    resumed, trainer = _train(tmp_path / "cut")
    assert trainer.resumed_from.name == "step-00000004" and trainer.global_step == 14
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []


def test_a_resume_on_another_base_is_refused_in_one_line(tmp_path):
    _train(tmp_path, max_steps=2)
    with pytest.raises(CheckpointError) as e:
        _train(tmp_path, model=gpt2(seed=1), max_steps=3)
    text = str(e.value)
    assert "holds adapters trained on another base model: GPT2LMHeadModel sha256" in text
    assert "(29,056 parameters) in the checkpoint" in text and "\n" not in text
    with pytest.raises(CheckpointError, match="this run adds no adapters"):  # the same model, no adapters
        torchrig.Trainer(gpt2(), **settings(tmp_path, peft=None, max_steps=3, resume="latest")).fit(tokens())


def test_include_base_saves_the_whole_model(tmp_path):
    model = gpt2()
    torchrig.Trainer(model, max_steps=1, **settings(tmp_path, **{"checkpoint.include_base": True})).fit(tokens())
    assert set(load_file(tmp_path / "checkpoints" / "latest" / "model.safetensors")) == set(model.state_dict())
    assert json.loads((tmp_path / "checkpoints" / "latest" / "meta.json").read_text())["weights"] == "all"


def test_a_bf16_base_with_fp32_adapters_and_the_saving_in_the_summary(tmp_path, capsys):
    model = gpt2()
    trainer = torchrig.Trainer(model, max_steps=2, precision="bf16",
                               **settings(tmp_path, **{"peft.base_dtype": "bf16"}))
    trainer.fit(tokens())
    dtypes = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16} and {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    state = trainer.optimizers["default"].state
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    out = "".join(capsys.readouterr())
    assert "frozen weights in bf16: 56.8 KB (fp32 would take 113.5 KB; 56.8 KB saved)" in " ".join(out.split())
    assert "frozen base in bf16" in out


def test_refusals_say_why_in_one_line(tmp_path):
    cases = {
        ("peft.base_dtype", "nf4"): "keeps the base in 4 bits through bitsandbytes, whose kernels run on CUDA, and "
                                    "this run is on cpu",
        ("parallel.tp", 2): "lora with parallel.tp=2 is not supported (a tensor-parallel plan splits nn.Linear",
        ("parallel.pp", 2): "lora with parallel.pp=2 is not supported (each stage would have to save",
        ("quantize.qat", "int4-weight-only"): "with peft.method=lora is not supported",
        ("ema_decay", 0.9): "an EMA with peft.method=lora would average the frozen base too",
    }
    for (key, value), text in cases.items():
        extra = {"parallel.tp_plan": "auto"} if key == "parallel.tp" else {}
        with pytest.raises(ConfigError) as e:
            torchrig.Trainer(gpt2(), device="cpu", **settings(tmp_path, **{key: value}, **extra))
        assert text in str(e.value) and "\n" not in str(e.value), (key, str(e.value))
    with pytest.raises(ConfigError, match="'peft.base_dtype': bf16 keeps the frozen base in bf16 .* set precision=bf16"):
        torchrig.Trainer(gpt2(), **settings(tmp_path, **{"peft.base_dtype": "bf16"}))
    model = gpt2()
    with pytest.raises(ConfigError, match="so an optimizer built before it holds none of them"):
        torchrig.Trainer(model, torch.optim.AdamW(model.parameters()), **settings(tmp_path))
    model = gpt2()  # a factory gets the parameters once the adapters are in
    trainer = torchrig.Trainer(model, lambda params: torch.optim.SGD(params, lr=0.1), **settings(tmp_path))
    assert len(trainer.optimizers["default"].param_groups[0]["params"]) == 16
