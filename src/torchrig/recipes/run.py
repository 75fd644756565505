"""Drive any recipe: train from a config, evaluate or predict from a checkpoint."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, NamedTuple, Optional

from .. import config as C
from ..errors import suggest
from ..trainer.provenance import code_specs, is_spec
from . import factory, get_recipe
from .base import RecipeError, check_output_kind, saved_bytes, write_output


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                 recipe: Optional[str] = None) -> C.Config:
    """Defaults < the recipe's defaults < (a resume: the run's own config, see :func:`resumed_config`) < the YAML
    file < ``--set`` overrides (< ``--recipe``)."""
    probe = C.load_config(path, overrides)  # validates keys early and tells which recipe is asked for
    file_map = C.read_yaml(path) if path else {}
    named = recipe or "recipe" in file_map or any(o.partition("=")[0].strip() == "recipe" for o in overrides or [])
    given = list(overrides or []) + [f"{key}=" for key in C.flat_keys(file_map)]  # the keys this command names
    saved = resumed_config(probe, given)
    saved_data = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    # your own data (--data) without a recipe named: the recipe with no data of its own
    own_data = probe.data.factory or saved_data.get("factory")
    name = recipe or (probe.recipe if named else saved.get("recipe") or ("custom" if own_data else probe.recipe))
    return recipe_config(name, _merge(saved, file_map), overrides)


def recipe_config(name: str, mapping: dict, overrides: Optional[list[str]] = None) -> C.Config:
    """Defaults < recipe ``name``'s defaults < ``mapping`` (a config file's keys) < ``overrides`` (``KEY=VALUE``)."""
    base = _merge(get_recipe(name).defaults, {"recipe": name})
    cfg = C.load_config(None, overrides, base=_merge(base, mapping))
    cfg.recipe = name
    return cfg


def run_train(cfg: C.Config, out=print) -> dict:
    """Train ``cfg``'s recipe; without ``run_dir`` the run gets a new numbered ``runs/<recipe>/N``."""
    from .. import runtime
    from ..checkpoint.rundir import check_not_in_use, discard_unused, numbered_run_dir

    owns_group, numbered, where = False, not cfg.run_dir, Announce(out)
    try:
        if numbered:
            owns_group = join_process_group(cfg)  # the ranks must agree on the number: rank 0 tells them
            cfg.run_dir = str(numbered_run_dir(Path("runs") / cfg.recipe, say=where.lines.append,
                                                  resume=cfg.resume in ("latest", "best")))  # a path: a new run
        elif runtime.is_main_process():
            check_not_in_use(cfg.run_dir)  # at once, before seconds of building data and model
        return _train(cfg, out, where)
    except BaseException:
        if numbered and cfg.run_dir and runtime.get_rank() == 0:
            discard_unused(Path(cfg.run_dir))
        raise
    finally:
        if owns_group:
            runtime.destroy_process_group()


class Announce:
    """Says which numbered run directory a run writes to once it starts training (``on_fit_start``): a start that
    fails before says nothing of a folder that is then removed (the error, or the end of the run, names it)."""

    def __init__(self, out=print) -> None:
        self.lines: list[str] = []  # filled on rank 0 only
        self.out = out

    def on_fit_start(self, trainer: Any) -> None:
        for line in self.lines:
            self.out(line)
        self.lines.clear()


def join_process_group(cfg: C.Config) -> bool:
    """Join the process group now (the Trainer then uses it); True when this call created it."""
    from .. import runtime

    d = cfg.dist
    info = runtime.detect(d.init_method, d.rank, d.world_size)
    if not info.is_distributed:
        return False
    device = runtime.select_device(cfg.device, info.local_rank)
    return runtime.init_process_group(info, device, d.backend, d.init_method, d.timeout)


def build_run(cfg: C.Config, callbacks: Optional[list] = None):
    """``(recipe, data, trainer)`` for ``cfg`` as ``torchrig train`` builds them; ``callbacks`` join the recipe's."""
    from ..runtime import seed_everything
    from ..trainer import Trainer

    recipe = get_recipe(cfg.recipe)
    seed_everything(cfg.seed)  # the initial weights come from the seed too (every rank builds the same model)
    factory.refuse_pack(recipe, cfg)
    model = factory.build_model(recipe, cfg)
    prepare_model(model, cfg)
    data = factory.build_data(recipe, cfg)
    kwargs = {**recipe.trainer_kwargs(cfg, data), **factory.trainer_objects(cfg)}  # loss: MODULE:FN, imported
    own = [k for k in ("step_fn", "eval_fn", "predict_fn") if kwargs.get(k) is not None]
    if own and cfg.parallel.pp != 1:
        raise C.ConfigError(f"config key 'parallel.pp': {cfg.parallel.pp}, but recipe {recipe.name!r} runs a {own[0]} of "
                            f"its own, which a model cut into pipeline stages cannot run; train it with parallel.tp or "
                            f"dist.strategy=fsdp, or set parallel.pp=1")
    if callbacks:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
    trainer = Trainer(model, config=cfg, **kwargs)
    trainer.config_builds_model = True  # the saved config.yaml rebuilds this model (evaluate, predict)
    return recipe, data, trainer


@contextlib.contextmanager
def run_without_training(config: Optional[str], overrides: list[str], recipe: Optional[str] = None,
                         model: Optional[str] = None, data: Optional[str] = None):
    """``(data, trainer)`` of a run as ``torchrig train`` would build it (``--model`` / ``--data`` factories
    included), for a command that looks at the run without training it (``summary``, ``lr-find``); the trainer is
    closed after. Without a ``run_dir`` it lives in a temporary folder: a recipe may name files there, none is kept."""
    import tempfile

    factories = [f"{key}={spec}" for key, spec in (("model.factory", model), ("data.factory", data)) if spec]
    cfg = build_config(config, list(overrides) + factories, recipe)
    with tempfile.TemporaryDirectory() as unused:
        cfg.run_dir = cfg.run_dir or unused
        _, built, trainer = build_run(cfg)
        try:
            yield built, trainer
        finally:
            trainer.close()


def _train(cfg: C.Config, out, where: Announce) -> dict:
    from ..runtime import stop_phase

    recipe, data, trainer = build_run(cfg, [where])
    try:
        run = trainer.open_run()  # locked and checked before the recipe writes its files there
        if trainer.is_main:
            recipe.save_artifacts(cfg, run)
        trainer.fit(data["train"], val_data=data.get("val"))
        results: dict[str, Any] = {}
        test = data.get("test")
        if test is not None:
            stop_phase(f"during the final evaluation on the test split, after training finished; "
                       f"torchrig evaluate --checkpoint {run} gives the test metrics")
            results = trainer.evaluate(test)
        stop_phase(f"after the run finished; its results are in {run}")
        trainer.logger.finish({f"test/{k}": v for k, v in results.items()})  # the trackers' final metrics
        if trainer.is_main:
            shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items())
            out(f"test: {shown}" if results else "training finished")
            out(f"run dir:     {run}")
            out(f"checkpoints: {run / 'checkpoints'} (latest -> {_readlink(run / 'checkpoints' / 'latest')})")
            out(f"logs:        {run / 'metrics.jsonl'}")
            if (run / "tensorboard").exists():  # a line of its own: paths are never cut to fit a terminal
                out(f"tensorboard: {run / 'tensorboard'}")
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


# Keys of a checkpoint's config.yaml that describe the process and the machine that wrote it, not the
# model: how it joined a process group (a crafted dist.init_method would make this process join a stranger's
# group), devices, threads, loader workers, logs and trackers, what to resume or overwrite. A checkpoint read
# back never decides them: they take this run's values (the defaults, then --set). The rules for every key
# are in docs/reliability.md ("What a checkpoint may decide").
THIS_RUN = ("dist", "parallel", "device", "threads", "interop_threads", "data.num_workers", "data.prefetch_factor",
            "data.pin_memory", "log", "profile", "resume", "resume_weights_only", "overwrite", "run_dir",
            "model.weights", "checkpoint.verify")
_JOINING = ("init_method", "rank", "world_size", "backend")  # the dist keys a note names when they were set


def without_keys(saved: dict, keys: tuple[str, ...] = THIS_RUN) -> dict:
    """``saved`` (a config read back from a file) without ``keys`` (sections or dotted keys): each of them then
    takes this process's value, the default or ``--set``. ``saved`` itself is left as it was."""
    kept = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for key in keys:
        section, _, name = key.rpartition(".")
        owner = kept.get(section) if section else kept
        if isinstance(owner, dict):
            owner.pop(name, None)
    return kept


def joining_note(saved: dict, source: str) -> Optional[str]:
    """The line saying that the dist keys ``saved`` sets (``dist.init_method`` ...) are ignored, or None."""
    dist = saved.get("dist") if isinstance(saved.get("dist"), dict) else {}
    joined = {k: dist[k] for k in _JOINING if dist.get(k) is not None}
    if not joined:
        return None
    shown = ", ".join(f"dist.{k}={v}" for k, v in joined.items())
    return (f"torchrig: {source} names {shown}; ignored: how this process joins a process group comes from this "
            f"command line and its environment only (torchrun's RANK, WORLD_SIZE, MASTER_ADDR)")


def inference_config(saved: dict, path: Path, overrides: Optional[list[str]] = None, say=None) -> C.Config:
    """The config to evaluate or predict with: the checkpoint's ``saved`` config.yaml without the keys of
    ``THIS_RUN``, then ``overrides`` (``KEY=VALUE``); ``say`` (stderr by default) notes dropped dist keys."""
    import sys

    kept = without_keys(saved)
    note = joining_note(saved, f"checkpoint '{path}'")
    if note:
        (say or (lambda text: print(text, file=sys.stderr)))(note)
    cfg = C.from_dict(kept)
    # artifacts (tokenizer, class map) are read from the run directory the checkpoint lies in, or from itself
    cfg.run_dir = str(path.parent.parent if path.parent.name == "checkpoints" else path)
    if cfg.precision == "fp16":
        import torch

        if not torch.cuda.is_available():
            cfg.precision = "fp32"  # fp16 needs CUDA; on a CPU-only machine evaluate in fp32
    for item in overrides or []:
        key, _, raw = item.partition("=")
        C.set_key(cfg, key.strip(), raw)
    return C.validate(cfg)


# Keys that a resume takes from the run it continues although evaluate does not (they are in a section of
# ``THIS_RUN``): plain switches of what is computed, which a resume would otherwise refuse as changed.
RESUME_TAKES = ("dist.sync_batchnorm", "dist.broadcast_buffers")
# Keys that a resume never takes from the run: besides ``THIS_RUN``, whether changed settings are allowed (a
# resume that once allowed them must not allow the next one's).
RESUME_DROPS = (*THIS_RUN, "resume_changes")


def resumed_config(probe: C.Config, given: list[str]) -> dict:
    """For ``train --set resume=…``: the config of the checkpoint to resume, as the mapping this command's config
    file and ``--set`` go on top of, so that a resume needs no setting typed again (a changed one is then refused
    or allowed as before, ``trainer/changes.py``). {} when there is no checkpoint to read (yet).

    ``config.yaml`` is a stranger's file, read as ``evaluate`` reads it: the keys of ``RESUME_DROPS`` take this
    command's values, a factory it names is imported only when it is the run's own file (unless ``given``, this
    command's ``KEY=VALUE`` items, names it). ``resume_weights_only`` starts a new run from those weights: only the
    recipe and the factories that rebuild the same model and data are taken."""
    if probe.resume is None:
        return {}
    from ..checkpoint import CheckpointError, read_config, read_meta, resolve
    from ..checkpoint.rundir import check_resumable

    check_resumable(probe.run_dir, probe.resume)  # at once, before seconds of building data and model
    try:  # config.yaml and meta.json alone (regular files, capped, safe YAML), not the optimizer state beside them
        path = resolve(probe.resume, probe.run_dir)
        saved = read_config(path, probe.checkpoint.verify) if path is not None else None
        meta = read_meta(path) if path is not None else None
    except (CheckpointError, OSError, ValueError):
        return {}  # the resume itself reports what is wrong with the checkpoint
    if not isinstance(saved, dict):
        return {}
    kept = _model_source(without_keys(saved)) if probe.resume_weights_only else _resumed_keys(saved)
    try:
        cfg = C.from_dict(kept)
    except C.ConfigError as exc:
        raise CheckpointError(f"'{path / 'config.yaml'}' does not hold a config this torchrig can resume ({exc}); "
                              f"resume from another checkpoint, or start a new run") from None
    for key, spec in factories_read_back(cfg, given):  # code the checkpoint names: only the run's own file
        factory.check_saved_spec(spec, key, path, meta)
    built = saved.get("model") if isinstance(saved.get("model"), dict) else {}
    if built.get("python_class") and not (built.get("factory") or probe.model.factory):
        raise factory.FactoryError(factory.python_built_message(path, str(built["python_class"]),
                                                                "pass resume= to its Trainer", ""))
    _say_resumed(saved, path, probe.resume, whole=not probe.resume_weights_only)
    return kept


def _resumed_keys(saved: dict) -> dict:
    """``saved`` without ``RESUME_DROPS``, with ``RESUME_TAKES`` put back."""
    kept = without_keys(saved, RESUME_DROPS)
    for key in RESUME_TAKES:
        section, _, name = key.partition(".")
        owner = saved.get(section)
        if isinstance(owner, dict) and name in owner:
            kept.setdefault(section, {})[name] = owner[name]
    return kept


def _model_source(kept: dict) -> dict:
    """What of ``kept`` rebuilds the same model and data: the recipe, and each factory with its options."""
    out: dict = {}
    for section in ("model", "data"):
        part = kept.get(section)
        if isinstance(part, dict) and part.get("factory"):
            out[section] = {k: part[k] for k in ("factory", "options") if k in part}
    if out and "recipe" in kept:
        out["recipe"] = kept["recipe"]
    for key in ("loss", "metrics"):  # a loss or metrics of the user's own code (MODULE:NAME) belong to the model too
        value = kept.get(key)
        if is_spec(value) or (isinstance(value, list) and any(is_spec(m) for m in value)):
            out[key] = value
    return out


def _say_resumed(saved: dict, path: Path, resume: str, whole: bool) -> None:
    from .. import runtime

    if not runtime.is_main_process():
        return
    note = joining_note(saved, f"checkpoint '{path}'")
    if note:
        print(note)
    if whole:
        print(f"torchrig: resume={resume}: the run's settings are read back from {path / 'config.yaml'}; this "
              f"command's config file and --set go on top")


def factories_read_back(cfg: C.Config, overrides: Optional[list[str]] = None) -> list[tuple[str, str]]:
    """``(key, spec)`` of each ``MODULE:NAME`` (``model.factory``, ``data.factory``, ``loss``, ``metrics[i]``) that
    ``cfg`` names and ``overrides`` (this command line's ``KEY=VALUE``) do not: code that a file read back names,
    not the user."""
    given = given_keys(overrides)
    return [(key, spec) for key, spec in code_specs(cfg) if key.partition("[")[0] not in given]


def given_keys(overrides: Optional[list[str]]) -> set[str]:
    """The keys this command line's ``KEY=VALUE`` overrides set."""
    return {item.partition("=")[0].strip() for item in overrides or []}


def given_verify(overrides: Optional[list[str]]) -> bool:
    """``checkpoint.verify`` as this command line sets it: the checkpoint's own config.yaml, read under it,
    never decides it."""
    probe = C.Config()
    for item in overrides or []:
        key, _, raw = item.partition("=")
        if key.strip() == "checkpoint.verify":
            C.set_key(probe, "checkpoint.verify", raw)
    return probe.checkpoint.verify


class Loaded(NamedTuple):
    """A checkpoint's model as ``evaluate``, ``predict`` and ``export`` use it."""

    recipe: Any
    cfg: C.Config
    model: Any              # the recipe's model with the checkpoint's weights (and its adapters, if any)
    path: Path              # the checkpoint directory
    adapted: Any            # optim.adapters.Adapted (peft's PeftModel around the model) or None
    meta: dict              # its meta.json


def load_for_inference(checkpoint: str, overrides: Optional[list[str]] = None):
    """(recipe, cfg, model with the checkpoint's weights, checkpoint dir) on the configured device."""
    got = load_checkpoint_model(checkpoint, overrides)
    return got.recipe, got.cfg, got.model, got.path


def load_checkpoint_model(checkpoint: str, overrides: Optional[list[str]] = None) -> Loaded:
    """The model of ``checkpoint`` with its weights, and what it was built from (see :class:`Loaded`)."""
    from ..checkpoint import CheckpointError, load_into, load_weights_file, read_checkpoint, resolve, say_unverified

    path, verify = resolve(checkpoint), given_verify(overrides)
    if path is None:
        raise CheckpointError(f"no checkpoint found at '{checkpoint}'")
    if not verify:
        say_unverified(path)
    _, meta, saved = read_checkpoint(path, verify)
    if saved is None:
        raise CheckpointError(f"checkpoint '{path}' has no config.yaml; it was not written by torchrig train")
    if not isinstance(saved, dict):
        raise CheckpointError(f"'{path / 'config.yaml'}' holds a {type(saved).__name__}, not a mapping of config "
                              f"keys; use a checkpoint written by torchrig train")
    cfg = inference_config(saved, path, overrides)
    for key, spec in factories_read_back(cfg, overrides):  # code the checkpoint names: only the run's own file
        factory.check_saved_spec(spec, key, path, meta)
    if cfg.model.python_class and not cfg.model.factory:
        raise CheckpointError(factory.python_built_message(path, cfg.model.python_class))
    if cfg.model.python_class and "recipe" not in given_keys(overrides):
        cfg.recipe = "custom"  # its data came from Python (recorded as digits before custom was recorded)
    recipe = get_recipe(cfg.recipe)
    model, adapted = fine_tuned_model(recipe, cfg, meta, path)
    load_into(model, load_weights_file(path, verify), source=f"checkpoint '{path}'",
              frozen_kept=meta.get("weights") == "trainable")
    return Loaded(recipe, cfg, model, path, adapted, meta)


def base_model(recipe, cfg: C.Config, meta: dict):
    """The recipe's model as the run built it before any adapter: from the same seed (a model built from its config
    gets the run's initial weights) and, for a checkpoint of adapters alone, ``model.init`` and ``model.weights``."""
    from ..runtime import seed_everything

    seed_everything(cfg.seed)
    model = factory.build_model(recipe, cfg)
    if meta.get("weights") == "trainable":
        prepare_model(model, cfg)  # the base the run trained on: model.init, and model.weights given again
    return model


def fine_tuned_model(recipe, cfg: C.Config, meta: dict, path: Path):
    """``(model, adapters)``: the recipe's model as the run built it, with its peft adapters and torchao's fake
    quantisation as the run put them in (``adapters``: ``optim.adapters.Adapted`` or None). A checkpoint of adapters
    alone (``weights: trainable``) needs the base the run trained them on: built again from the same seed,
    ``model.init`` and ``model.weights`` (given again: a checkpoint never names a file to read), then checked
    against the base's sha256 the checkpoint recorded."""
    from ..optim import adapters, qat
    from ..runtime import select_device
    from ..trainer.provenance import check_base

    model = base_model(recipe, cfg, meta)
    adapted = adapters.prepare(model, cfg, select_device(cfg.device, 0))
    check_base(meta, adapted.base if adapted else None, path)
    qat.prepare(model, cfg.quantize)
    return model, adapted


def _inference_trainer(recipe, cfg: C.Config, model, data: dict):
    from ..trainer import Trainer

    cfg.log.progress = "none"
    cfg.log.tensorboard = False
    cfg.peft, cfg.quantize = type(cfg.peft)(), type(cfg.quantize)()  # the model holds its adapters already
    return Trainer(model, config=cfg, **recipe.trainer_kwargs(cfg, data), **factory.trainer_objects(cfg))


def run_evaluate(checkpoint: str, split: str = "test", overrides: Optional[list[str]] = None) -> dict:
    recipe, cfg, model, path = load_for_inference(checkpoint, overrides)
    data = factory.build_data(recipe, cfg, missing=f"checkpoint '{path}' names no data to evaluate on (recipe "
                                                   f"'{recipe.name}'); pass --set data.factory=MODULE:FN, a function "
                                                   f"of yours that returns (train, val, test)")
    if split not in data or data[split] is None:
        raise RecipeError(f"recipe '{recipe.name}' has no '{split}' split; choose one of "
                          f"{', '.join(k for k, v in data.items() if v is not None)}")
    with _inference_trainer(recipe, cfg, model, data) as trainer:
        return trainer.evaluate(data[split])


def run_predict(checkpoint: str, inputs: str, output: str, topk: int = 5,
                overrides: Optional[list[str]] = None, features: Optional[list[str]] = None,
                all_outputs: bool = False, activation: str = "auto") -> Path:
    """Predict; ``features`` names modules whose outputs are also saved, as ``.npy`` beside ``output``;
    ``all_outputs``: the model's whole output, field by field, in ``output`` (``.npz`` or ``.safetensors``);
    ``activation``: what is applied to the prediction (``Trainer.predict``'s)."""
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise RecipeError(f"predict --topk {topk}: expected an integer >= 1, the number of classes to report per "
                          f"input (default 5)")
    out = Path(output).expanduser()
    if all_outputs and out.suffix.lower() not in (".npz", ".safetensors"):
        raise RecipeError(f"predict --all-outputs --output '{output}': the whole output is written field by field "
                          f"as .npz (numpy) or .safetensors; name the file e.g. predictions.npz")
    recipe, cfg, model, path = load_for_inference(checkpoint, overrides)
    if not all_outputs and recipe.output_kinds:
        check_output_kind(out, recipe.output_kinds)  # before any prediction is computed
    x, names = recipe.load_inputs(cfg, Path(inputs).expanduser())
    with _inference_trainer(recipe, cfg, model, {}) as trainer, FeatureHooks(model, features or []) as hooks:
        if features and trainer.world_size > 1:
            raise RecipeError("predict --features runs in one process; start it without torchrun")
        outputs = trainer.predict(x, activation=activation, outputs="all" if all_outputs else "prediction")
    if trainer.is_main:
        if all_outputs:
            write_fields(outputs, out)
        else:
            recipe.write_predictions(cfg, outputs, names, out, topk=topk)
        hooks.save(out)
    return out


def write_fields(outputs: Any, out: Path) -> None:
    """``predict --all-outputs``: every per-sample field as one array (a tensor output: ``prediction``; a tuple's
    elements by index, ``0``, ``1`` …; a dict's by key), in ``.npz`` (numpy) or ``.safetensors``."""
    import torch

    if isinstance(outputs, torch.Tensor):
        fields = {"prediction": outputs}
    elif isinstance(outputs, tuple):
        fields = {str(i): v for i, v in enumerate(outputs) if isinstance(v, torch.Tensor)}
    elif isinstance(outputs, dict):
        fields = {str(k): v for k, v in outputs.items() if isinstance(v, torch.Tensor)}
    else:
        raise RecipeError(f"predict --all-outputs: the predictions are a {type(outputs).__name__}, not tensors; "
                          f"write them without --all-outputs")
    if out.suffix.lower() == ".safetensors":
        from safetensors.torch import save

        write_output(out, save({k: v.contiguous() for k, v in fields.items()}))
    else:
        import numpy as np

        arrays = {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in fields.items()}
        write_output(out, saved_bytes(np.savez, **arrays))


class FeatureHooks:
    """Forward hooks that keep the outputs of named modules (``model.get_submodule`` names)."""

    def __init__(self, model, names: list[str]):
        self.names, self.chunks, self.handles, self.files = list(names), {n: [] for n in names}, [], []
        modules = dict(model.named_modules())
        for name in self.names:
            if name not in modules:
                
                leaves = [n for n, m in model.named_children()]
                listing = f"Top-level modules: {', '.join(leaves)} (names as in model.named_modules())"
                hint = suggest(name, [n for n in modules if n], listing=listing, n=3)
                raise RecipeError(f"--features: the model has no module '{name}'{hint}")
            self.handles.append(modules[name].register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def keep(module, args, output):
            while isinstance(output, (tuple, list)) and output:
                output = output[0]
            if hasattr(output, "detach"):
                self.chunks[name].append(output.detach().float().cpu())
        return keep

    def save(self, out: Path) -> list[Path]:
        import numpy as np
        import torch

        for name, chunks in self.chunks.items():
            if not chunks:
                continue
            shape = [max(c.shape[d] for c in chunks) for d in range(1, chunks[0].ndim)]
            padded = []
            for c in chunks:  # variable-length outputs (sequences): zero-pad to the longest
                pad = []
                for d in range(c.ndim - 1, 0, -1):
                    pad += [0, shape[d - 1] - c.shape[d]]
                padded.append(torch.nn.functional.pad(c, pad) if any(pad) else c)
            base = out if (out.is_dir() or not out.suffix) else out.parent
            stem = "features" if base is out else out.stem + ".features"
            file = base / f"{stem}.{name}.npy"
            write_output(file, saved_bytes(np.save, torch.cat(padded).numpy()))
            self.files.append(file)
            print(f"features of '{name}' {tuple(torch.cat(padded).shape)} written to {file}")
        return self.files

    def __enter__(self) -> "FeatureHooks":
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def prepare_model(model, cfg: C.Config) -> None:
    """``model.init`` (Conv / Linear re-initialisation), then ``model.weights`` (a local file)."""
    if cfg.model.init:
        from ..models.init import apply_init

        apply_init(model, cfg.model.init)
    if cfg.model.weights:
        from ..checkpoint import load_weights_file, say_unverified
        from .base import load_weights_partial

        if not cfg.checkpoint.verify:
            say_unverified(Path(cfg.model.weights))
        load_weights_partial(model, load_weights_file(Path(cfg.model.weights), cfg.checkpoint.verify),
                             cfg.model.weights)
