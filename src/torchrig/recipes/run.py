"""Drive any recipe: train from a config, evaluate or predict from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .. import config as C
from . import get_recipe


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                 recipe: Optional[str] = None) -> C.Config:
    """Defaults < the recipe's defaults < the YAML file < ``--set`` overrides (< ``--recipe``)."""
    probe = C.load_config(path, overrides)  # validates keys early and tells which recipe is asked for
    name = recipe or probe.recipe
    base = _merge(get_recipe(name).defaults, {"recipe": name})
    file_map = C.read_yaml(path) if path else {}
    cfg = C.load_config(None, overrides, base=_merge(base, file_map))
    cfg.recipe = name
    return cfg


def run_train(cfg: C.Config, out=print) -> dict:
    from ..trainer import Trainer

    recipe = get_recipe(cfg.recipe)
    model = recipe.build_model(cfg)
    data = recipe.build_data(cfg)
    trainer = Trainer(model, config=cfg, **recipe.trainer_kwargs(cfg, data))
    try:
        if trainer.is_main:
            recipe.save_artifacts(cfg, Path(cfg.run_dir))
        trainer.fit(data["train"], val_data=data.get("val"))
        results: dict[str, Any] = {}
        test = data.get("test")
        if test is not None:
            results = trainer.evaluate(test)
        if trainer.is_main:
            run = Path(cfg.run_dir)
            shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items())
            out(f"test: {shown}" if results else "training finished")
            out(f"checkpoints: {run / 'checkpoints'} (latest -> {_readlink(run / 'checkpoints' / 'latest')})")
            out(f"logs:        {run / 'metrics.jsonl'}" + (f" · tensorboard: {run / 'tensorboard'}"
                                                          if (run / 'tensorboard').exists() else ""))
            plots = getattr(trainer, "plots", [])
            if plots:
                out(f"plots:       {', '.join(str(p) for p in plots)}")
        return results
    finally:
        trainer.close()


def _readlink(p: Path) -> str:
    try:
        import os

        return os.readlink(p)
    except OSError:
        return "none"


def load_for_inference(checkpoint: str, overrides: Optional[list[str]] = None):
    """(recipe, cfg, model with the checkpoint's weights, checkpoint dir) on the configured device."""
    from ..checkpoint import CheckpointError, load_into, load_weights_file, read_checkpoint, resolve

    path = resolve(checkpoint)
    if path is None:
        raise CheckpointError(f"no checkpoint found at '{checkpoint}'")
    _, _, saved = read_checkpoint(path)
    if saved is None:
        raise CheckpointError(f"checkpoint '{path}' has no config.yaml; it was not written by torchrig train")
    cfg = C.from_dict(saved)
    cfg.resume = None
    cfg.dist.strategy = "none" if cfg.dist.strategy == "fsdp" else cfg.dist.strategy
    if cfg.device not in ("auto", "cpu"):
        cfg.device = "auto"  # a GPU-trained checkpoint must evaluate on a CPU-only machine
    for item in overrides or []:
        key, _, raw = item.partition("=")
        C._set_path(cfg, key.strip(), raw)
    C.validate(cfg)
    recipe = get_recipe(cfg.recipe)
    cfg.model.weights = None
    model = recipe.build_model(cfg)
    load_into(model, load_weights_file(path), source=f"checkpoint '{path}'")
    return recipe, cfg, model, path


def _inference_trainer(recipe, cfg: C.Config, model, data: dict):
    from ..trainer import Trainer

    cfg.log.progress = "none"
    cfg.log.tensorboard = False
    return Trainer(model, config=cfg, **recipe.trainer_kwargs(cfg, data))


def run_evaluate(checkpoint: str, split: str = "test", overrides: Optional[list[str]] = None) -> dict:
    recipe, cfg, model, path = load_for_inference(checkpoint, overrides)
    data = recipe.build_data(cfg)
    if split not in data or data[split] is None:
        raise ValueError(f"recipe '{recipe.name}' has no '{split}' split; choose one of "
                         f"{', '.join(k for k, v in data.items() if v is not None)}")
    with _inference_trainer(recipe, cfg, model, data) as trainer:
        return trainer.evaluate(data[split])


def run_predict(checkpoint: str, inputs: str, output: str, topk: int = 5,
                overrides: Optional[list[str]] = None) -> Path:
    recipe, cfg, model, path = load_for_inference(checkpoint, overrides)
    x, names = recipe.load_inputs(cfg, Path(inputs))
    with _inference_trainer(recipe, cfg, model, {}) as trainer:
        outputs = trainer.predict(x)
    out = Path(output)
    if trainer.is_main:
        recipe.write_predictions(cfg, outputs, names, out, topk=topk)
    return out


def dumps(results: dict) -> str:
    return json.dumps(results, sort_keys=True)
