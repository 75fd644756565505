"""Your own model and data on the command line: ``torchrig train --model pkg.module:build_model
--data pkg.module:build_data``.

A factory is named ``module:attribute`` (``attribute`` may be dotted, ``Class.method``) and imported
with the current directory first on ``sys.path``, as ``python -m`` would. Both factories take the run's
:class:`torchrig.Config` (``cfg.model.options`` / ``cfg.data.options`` carry their own keywords):

- ``build_model(cfg)`` returns an ``nn.Module``;
- ``build_data(cfg)`` returns the training data (a ``Dataset``, a ``DataLoader``, or a tuple of
  tensors such as ``(x, y)``), or ``(train, val)``, or ``(train, val, test)`` (``val`` may be None),
  or a dict with the keys ``train`` / ``val`` / ``test``.

The specs are saved in the run's ``config.yaml`` as ``model.factory`` / ``data.factory``, so
``torchrig evaluate`` and ``predict`` rebuild the same model (and data) from a checkpoint, and ``train
--set resume=…`` the same run. A spec read from a checkpoint is code a crafted ``config.yaml`` could
point anywhere, so it is imported only when it resolves to the very file the run was trained with
(recorded in ``meta.json``), under the current directory, and never to a file that came with the
checkpoint (:func:`check_saved_spec`); pass the spec again on the command line (``--set
model.factory=…``) to use another one, such as an installed package or a project moved elsewhere.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import config as C
from ..data.packing import is_packed
from ..errors import suggest
from ..trainer.provenance import is_spec
from .base import RecipeError

SPLITS = ("train", "val", "test")


class FactoryError(RecipeError):
    """A ``--model`` / ``--data`` factory that cannot be imported, called, or returned the wrong thing."""


def load_factory(spec: str, key: str) -> Callable:
    """The callable named by ``spec`` (``module:attr``); ``key`` (``model.factory``) names it in errors."""
    obj = load_attribute(spec, key)
    if not callable(obj):
        raise FactoryError(f"{key} '{spec}': '{spec.partition(':')[2]}' is a {type(obj).__name__}, not a function; "
                           f"name a function that takes the config")
    return obj


def load_attribute(spec: str, key: str) -> Any:
    """What ``spec`` (``module:attr``) names, imported; ``key`` (``model.factory``, ``loss``) names it in errors."""
    module_name, _, attr = spec.partition(":")
    where = f"{key} '{spec}'"
    if not module_name or not attr:
        raise FactoryError(f"{where}: expected 'module:attribute', e.g. mypkg.models:build_model")
    if module_name.partition(".")[0] in sys.stdlib_module_names:
        # a spec read from a checkpoint's config.yaml must not reach os, subprocess, shutil …
        raise FactoryError(f"{where}: '{module_name}' is a standard-library module; name a function of your own "
                           f"(module:function) that builds from the config")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)  # like `python -m`: modules beside you are found
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise FactoryError(f"{where}: module '{module_name}' not found (searched the current directory "
                               f"{here} and sys.path); run from the folder that holds it or install it") from None
        raise FactoryError(f"{where}: importing module '{module_name}' failed: {exc}") from None
    except Exception as exc:
        raise FactoryError(f"{where}: importing module '{module_name}' raised {type(exc).__name__}: "
                           f"{_first_line(exc)}") from None
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part) and isinstance(obj, types.ModuleType):
            try:  # a submodule not imported by its package
                importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                pass
        if not hasattr(obj, part):
            owner = module_name + "".join("." + p for p in attr.split(".")[:i])
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise FactoryError(f"{where}: '{owner}' has no attribute '{part}'{suggest(part, names)}")
        obj = getattr(obj, part)
    return obj


def check_saved_spec(spec: str, key: str, checkpoint: Path, meta: Any) -> None:
    """Refuse a factory that a checkpoint's ``config.yaml`` names unless importing it now runs the very file
    the run was trained with: the same module, resolved the same way (the current directory first on
    ``sys.path``) to the same file with the same bytes (``meta.json``'s ``factories`` record, see
    ``trainer/provenance.py``), under the current directory, and never a file that came with the checkpoint
    (inside its run directory, or a package that holds the checkpoint). Nothing is imported to decide.
    """
    module_name = spec.partition(":")[0]
    if module_name.partition(".")[0] in sys.stdlib_module_names:
        return  # load_factory refuses the standard library with its own message
    here = Path.cwd().resolve()
    if str(here) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(here))
    start = f"checkpoint '{checkpoint}': its config.yaml names {key} '{spec}'"
    fix = (f"torchrig imports a factory read back from a checkpoint only when it is the file the run was trained "
           f"with. Name it on the command line: {naming(key, 'MODULE:FUNCTION')}")
    chain = _module_chain(module_name)
    if chain is None:
        raise FactoryError(f"{start}, a module not found from the current directory {here}; {fix}")
    checkpoint = checkpoint.resolve()
    run = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    module_file = chain[-1]
    for place in chain:
        if (place.is_dir() and checkpoint.is_relative_to(place)) or place.is_relative_to(run):
            raise FactoryError(f"{start}, which is '{place}', a file or folder that holds the checkpoint or lies in "
                               f"its run directory {run}: torchrig never imports code that comes with a checkpoint. "
                               f"Name your own factory on the command line: {naming(key, 'MODULE:FUNCTION')}")
    if not module_file.is_relative_to(here):
        raise FactoryError(f"{start}, a module outside the current directory {here} ('{module_file}'); torchrig runs "
                           f"code named by a checkpoint only from there. Run from your project folder, or pass "
                           f"{naming(key, spec)} to use it")
    record = meta.get("factories", {}).get(key) if isinstance(meta, dict) and isinstance(
        meta.get("factories"), dict) else None
    if not isinstance(record, dict) or record.get("module") != module_name:
        raise FactoryError(f"{start}, but its meta.json does not record which file that module was imported from; "
                           f"{fix}")
    if record.get("file") != str(module_file):
        raise FactoryError(f"{start}, which resolves to '{module_file}' here, not to the file the run was trained "
                           f"with ('{record.get('file')}'); {fix}")
    if record.get("sha256") != _sha256(module_file):
        raise FactoryError(f"{start}, whose file '{module_file}' changed since the run was trained (its SHA-256 "
                           f"differs); {fix}")


def naming(key: str, spec: str) -> str:
    """How the command line names ``spec`` for ``key``: ``--set model.factory=SPEC``; a metric (``metrics[i]``) in
    the list of metrics, ``--set metrics=[SPEC]``."""
    return f"--set metrics=[{spec}]" if key.startswith("metrics") else f"--set {key}={spec}"


def _module_chain(name: str) -> Optional[list[Path]]:
    """The packages and the file importing ``name`` would run, found without importing anything: each
    package's folder and ``__init__.py`` (a namespace package's folders), then the module's file. None when
    the module is not found as a file of a path entry (a built-in, a zip, or nothing)."""
    import importlib.util

    chain: list[Path] = []
    found = None
    parts = name.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[:i + 1])
        try:
            if i == 0:
                found = importlib.util.find_spec(full)  # a top-level name: no package to import first
            else:
                found = getattr(sys.modules.get(full), "__spec__", None) or \
                    _find_in(full, list(found.submodule_search_locations))
        except (ImportError, ValueError):
            return None
        if found is None:
            return None
        folders = list(found.submodule_search_locations or [])
        if i < len(parts) - 1 and not folders:
            return None  # a module, not a package: it has no sub-module
        chain += [Path(f).resolve() for f in folders]
        if found.has_location and found.origin:
            chain.append(Path(found.origin).resolve())
        elif i == len(parts) - 1:
            return None  # a namespace package or a built-in: no file to vouch for
    return chain


def _find_in(name: str, folders: list[str]) -> Any:
    """The spec of sub-module ``name`` in its package's ``folders``, as the import system would find it
    (a regular module or package first, else the folders of a namespace package), without importing the
    package: ``PathFinder.find_spec`` would need it in ``sys.modules`` for a namespace package."""
    import importlib.machinery
    import pkgutil

    portions: list[str] = []
    for folder in folders:
        finder = pkgutil.get_importer(folder)
        found = finder.find_spec(name) if hasattr(finder, "find_spec") else None
        if found is not None and found.loader is not None:
            return found
        if found is not None:
            portions += list(found.submodule_search_locations or [])
    if not portions:
        return None
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = portions
    return spec


def _sha256(path: Path) -> Optional[str]:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def build_model(recipe, cfg: C.Config) -> nn.Module:
    """``model.factory(cfg)`` when the config names one, else the recipe's model."""
    if not cfg.model.factory:
        return recipe.build_model(cfg)
    model = _call(load_factory(cfg.model.factory, "model.factory"), cfg, f"model.factory '{cfg.model.factory}'")
    if not isinstance(model, nn.Module):
        raise FactoryError(f"model.factory '{cfg.model.factory}' returned a {type(model).__name__}, "
                           f"not a torch.nn.Module; return the model")
    return model


def refuse_pack(recipe, cfg: C.Config) -> None:
    """``data.pack: true`` for a recipe whose own data are not token documents: one line (before anything is built)."""
    why = recipe.pack_refusal(cfg) if cfg.data.pack and not cfg.data.factory else None
    if why:
        raise FactoryError(f"config key 'data.pack': true, but the {recipe.name} recipe does not pack: {why}; "
                           f"set data.pack=false")


def build_data(recipe, cfg: C.Config, missing: Optional[str] = None) -> dict[str, Any]:
    """``{"train", "val", "test"}`` from ``data.factory(cfg)`` when the config names one, else the recipe's;
    ``missing``: what to pass instead when the recipe has no data of its own (``custom``, a Python run's)."""
    if not cfg.data.factory:
        if missing is not None and not recipe.has_data:
            raise FactoryError(f"no data: {missing}")
        if cfg.data.sources and not recipe.reads_sources:
            raise C.ConfigError(f"config key 'data.sources': recipe {recipe.name!r} does not mix named sources (the "
                                f"language-model recipe does); give data.path, or a data.factory returning a "
                                f"torchrig.data.Mixture")
        refuse_pack(recipe, cfg)
        return recipe.build_data(cfg)
    spec = cfg.data.factory
    splits = as_splits(_call(load_factory(spec, "data.factory"), cfg, f"data.factory '{spec}'"),
                       f"data.factory '{spec}'")
    first = splits.get("train", next(iter(splits.values()), None))
    if cfg.data.pack and not is_packed(first):
        raise FactoryError(f"config key 'data.pack': true, but data.factory '{spec}' gave a "
                           f"{type(first).__name__}, not packed documents; return "
                           f"torchrig.data.PackedDocuments(token_lists, length) (docs/your-code.md), or set "
                           f"data.pack=false")
    return splits


def trainer_objects(cfg: C.Config) -> dict[str, Any]:
    """The Trainer's ``loss`` / ``metrics`` arguments for what the config names ``MODULE:NAME`` (``loss:
    mylm:lm_loss``, ``metrics: [accuracy, mylm:Perplexity]``), imported; empty when it names none (the Trainer
    takes the names from the config). The config keeps the specs: ``config.yaml`` records them, and evaluate and
    resume import them again under the rules of :func:`check_saved_spec`."""
    out: dict[str, Any] = {}
    if is_spec(cfg.loss):
        out["loss"] = load_loss(cfg.loss)
    if any(is_spec(m) for m in cfg.metrics or []):
        out["metrics"] = [load_metric(m) if is_spec(m) else m for m in cfg.metrics]
    return out


def load_loss(spec: str) -> Callable:
    """``loss: MODULE:NAME``: a function ``loss(output, target)``, or a loss class (an ``nn.Module``) built with no
    arguments."""
    fn = load_attribute(spec, "loss")
    if isinstance(fn, type):
        fn = _call(lambda _: fn(), None, f"loss '{spec}'")
    if not callable(fn):
        raise FactoryError(f"loss '{spec}' is a {type(fn).__name__}, not a loss; name a function loss(output, "
                           f"target) or an nn.Module class")
    return fn


def load_metric(spec: str) -> Any:
    """``metrics: [MODULE:NAME]``: a metric object (``torchrig.metrics.Metric``, a torchmetrics ``Metric`` or
    ``MetricCollection``), or a class or function that makes one with no arguments (a fresh one per run)."""
    from ..metrics import Metric
    from ..metrics.torchmetrics_adapter import torchmetrics_objects

    def is_metric(obj: Any) -> bool:
        return isinstance(obj, Metric) or torchmetrics_objects(obj) is not None

    obj = load_attribute(spec, "metrics")
    if not is_metric(obj) and callable(obj):
        obj = _call(lambda _: obj(), None, f"metrics '{spec}'")
    if not is_metric(obj):
        raise FactoryError(f"metrics '{spec}' is a {type(obj).__name__}, not a metric; name a torchrig.metrics.Metric "
                           f"or torchmetrics Metric (an object, or a class or function making one with no arguments)")
    return obj


def _call(fn: Callable, cfg: C.Config, where: str) -> Any:
    """``fn(cfg)``; an exception of the user's function becomes one line naming the factory (its own torchrig
    errors pass as they are, and --debug shows the traceback)."""
    from ..errors import TorchrigError

    try:
        return fn(cfg)
    except TorchrigError:
        raise
    except Exception as exc:
        raise FactoryError(f"{where} raised {type(exc).__name__}: {_first_line(exc)}; fix the factory (run with "
                           f"--debug to see where it failed)") from exc


def _is_data(x: Any) -> bool:
    if isinstance(x, (Dataset, DataLoader)):
        return True
    from torch import Tensor

    return isinstance(x, Tensor) or (isinstance(x, (tuple, list)) and len(x) > 0
                                      and all(isinstance(t, Tensor) for t in x))


def as_splits(value: Any, where: str) -> dict[str, Any]:
    """The data contract: one data set, ``(train, val[, test])``, or a dict of those splits."""
    expected = ("expected the training data (a Dataset, a DataLoader or a tuple of tensors), "
                "(train, val), (train, val, test), or a dict with 'train', 'val', 'test'")
    if _is_data(value):  # a tuple of tensors is one data set, (x, y)
        parts = {"train": value}
    elif isinstance(value, (tuple, list)) and len(value) in (2, 3):
        parts = dict(zip(SPLITS, value))
    elif isinstance(value, dict):
        unknown = [k for k in value if k not in SPLITS]
        if unknown:
            raise FactoryError(f"{where} returned a dict with key '{unknown[0]}'; {expected}")
        parts = dict(value)
    else:
        shown = f"a {len(value)}-item {type(value).__name__}" if isinstance(value, (tuple, list)) \
            else f"a {type(value).__name__}"
        raise FactoryError(f"{where} returned {shown}; {expected}")
    for name, part in parts.items():
        if part is None and name != "train":
            continue
        if not _is_data(part):
            raise FactoryError(f"{where} returned a {type(part).__name__} as its '{name}' split; {expected}")
    return parts


def python_built_message(path: Any, python_class: str,
                         then: str = "load its model.safetensors (Trainer.evaluate, torch.onnx.export …)",
                         data: str = " (or --input FILE)") -> str:
    """The one line for a checkpoint whose model (and so its data) was built in Python, not from its config."""
    return (f"checkpoint '{path}': this checkpoint was saved from a model and data built in Python "
            f"({python_class.replace(':', '.')}); rebuild them in Python and {then}, or pass --set "
            f"model.factory=MODULE:FN and --set data.factory=MODULE:FN{data}, functions of yours that build them")
