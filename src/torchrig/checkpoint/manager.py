"""Checkpoint directories in ``RUN_DIR/checkpoints``: atomic save, keep-last-k, best-k, ``latest``.

A checkpoint is a directory ``step-00000123`` holding ``model.safetensors``, ``state.pt``
(optimizers, schedulers, scaler, counters, RNG states), ``config.yaml`` and ``meta.json``. It is
written under a temporary name and renamed into place, then ``latest`` (a symbolic link) is
swapped atomically; so ``latest`` always names a complete checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from .io import (CheckpointError, fsync_dir, load_into, load_weights_file, safe_torch_load, safe_torch_save,
                 save_weights, write_bytes_atomic, write_json_atomic)

PREFIX = "step-"


def _link(target_name: str, link: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


def _hardlink_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def resolve(path: str | Path, run_dir: Optional[str | Path] = None) -> Optional[Path]:
    """A checkpoint directory from a path, a run dir, ``latest`` or ``best``; None if ``latest`` has none yet."""
    p = Path(path)
    if str(path) in ("latest", "best"):
        if run_dir is None:
            raise CheckpointError(f"resume={path!r} needs run_dir")
        link = Path(run_dir) / "checkpoints" / str(path)
        if not (link.exists() or link.is_symlink()):
            return None
        p = link
    if p.is_dir() and (p / "checkpoints").is_dir() and not (p / "model.safetensors").exists():
        return resolve("latest", p)  # a run directory
    if p.is_symlink() or p.name in ("latest", "best"):
        if p.is_file():  # a text file naming the checkpoint
            p = p.parent / p.read_text().strip()
        else:
            p = p.resolve()
    if not p.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist; give a checkpoint directory, a run directory or 'latest'")
    if p.is_file() and p.name == "model.safetensors":
        p = p.parent
    if not (p / "model.safetensors").exists():
        raise CheckpointError(f"'{p}' is not a torchrig checkpoint (no model.safetensors inside)")
    return p


class CheckpointManager:
    """The checkpoints of one run directory: ``{name: Stateful}`` mappings saved and loaded whole.

    ``save(step, states)`` / ``load(path, states)`` take the same mapping: ``"model"`` (an
    ``nn.Module``), ``"optimizers"`` (name -> optimizer) and any other objects with ``state_dict`` /
    ``load_state_dict``. The model goes to ``model.safetensors``, everything else to ``state.pt``;
    with ``sharded=True`` (FSDP2) model and optimizer shards go to ``sharded/`` through DCP as well.
    Several ranks: every rank calls ``save`` (some ``state_dict`` calls are collectives); only the
    one with ``writes=True`` writes, except the shards, which every rank writes.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 2, keep_best: int = 1, *, writes: bool = True,
                 sharded: bool = False):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.writes, self.sharded = writes, sharded
        self.last_step: Optional[int] = None  # the newest checkpoint this process saved or resumed from
        self.index_path = self.dir / "index.json"
        self.index: dict[str, Any] = {"checkpoints": [], "best": []}
        if self.index_path.exists():
            try:
                self.index = json.loads(self.index_path.read_text())
            except (OSError, ValueError):
                self.index = {"checkpoints": self._scan(), "best": []}

    def _scan(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob(f"{PREFIX}*") if (p / "model.safetensors").exists())

    def clean_partial(self) -> None:
        """Remove temporary directories left by a process killed mid-save (not one ``latest`` names)."""
        if self.dir.exists():
            latest = self.dir / "latest"
            keep = os.readlink(latest) if latest.is_symlink() else None
            for p in self.dir.glob(".tmp-*"):
                if p.name != keep:
                    shutil.rmtree(p, ignore_errors=True)

    # -- Stateful objects ---------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, Any], *, config: Optional[dict], meta: dict,
             metrics: Optional[dict] = None) -> Optional[Path]:
        """Checkpoint ``step`` of ``states``; its directory (None on ranks that write no directory)."""
        model, optimizers = states["model"], states["optimizers"]
        others = {k: v for k, v in states.items() if k not in ("model", "optimizers")}
        if self.sharded:
            from . import sharded

            path = sharded.save(self, step, model, optimizers, others, config, meta, metrics)
        else:
            state = {k: v.state_dict() for k, v in others.items()}  # on every rank: some are collectives
            state["optimizers"] = {k: o.state_dict() for k, o in optimizers.items()}
            path = self.write(step, model.state_dict(), state, config, meta, metrics) if self.writes else None
        self.last_step = step
        return path

    def load(self, path: Path, states: dict[str, Any], print_fn: Callable[[str], None] = print) -> dict:
        """Restore ``states`` from checkpoint ``path`` exactly, or raise; returns its meta."""
        if not (path / "state.pt").exists():
            raise CheckpointError(f"checkpoint '{path}' has no training state (state.pt), so it cannot resume "
                                  f"exactly; set resume_weights_only=true to load its weights and start a fresh "
                                  f"optimizer and schedule, or resume from another checkpoint")
        state, meta, _ = read_checkpoint(path)
        missing = [k for k in ("counters", "rng", "optimizers") if k not in state]
        if missing:
            raise CheckpointError(f"checkpoint '{path}' state.pt lacks {', '.join(missing)}, so it cannot resume "
                                  f"exactly; set resume_weights_only=true to load its weights only")
        model, optimizers = states["model"], states["optimizers"]
        if self.sharded or (path / "sharded").exists():
            from . import sharded

            sharded.load(model, optimizers, path, print_fn)
        else:
            load_into(model, load_weights_file(path), source=f"checkpoint '{path}'")
        try:
            for k, opt in optimizers.items():
                if k in state["optimizers"]:
                    opt.load_state_dict(state["optimizers"][k])
            for k, obj in states.items():
                if k not in ("model", "optimizers") and k in state:
                    obj.load_state_dict(state[k])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint '{path}' optimizer/scheduler state does not fit this run ({exc}); "
                                  f"was it made with a different optimizer or model?") from None
        self.last_step = int(state["counters"].get("global_step", meta.get("step", 0)))
        return meta

    # -- directories --------------------------------------------------------------------------------
    def write(self, step: int, weights: dict, state: dict, config: Optional[dict], meta: dict,
              metrics: Optional[dict] = None, extra_writer: Optional[Callable[[Path], None]] = None) -> Path:
        """Write checkpoint directory ``step`` atomically and make it ``latest``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{PREFIX}{step:08d}"
        tmp = self.dir / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if weights is not None:
            save_weights(weights, tmp / "model.safetensors")
        safe_torch_save(state, tmp / "state.pt")
        if config is not None:
            import yaml

            write_bytes_atomic(tmp / "config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
        meta = dict(meta, metrics=metrics or {}, saved_at=time.time())
        write_json_atomic(tmp / "meta.json", meta)
        if extra_writer is not None:
            extra_writer(tmp)
        fsync_dir(tmp)
        final = self.dir / name
        if final.exists():  # re-saving a step (epoch end, resumed run): `latest` must name a whole
            _link(tmp.name, self.dir / "latest")  # checkpoint at every instant, so it names tmp meanwhile
            fsync_dir(self.dir)
            trash = self.dir / f".tmp-trash-{name}-{os.getpid()}"
            staged = self.dir / f".tmp-staged-{name}-{os.getpid()}"
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(tmp, staged, copy_function=_hardlink_or_copy)
            fsync_dir(staged)
            os.replace(final, trash)
            os.replace(staged, final)
        else:
            os.replace(tmp, final)
        fsync_dir(self.dir)
        _link(name, self.dir / "latest")
        fsync_dir(self.dir)
        for leftover in (tmp, self.dir / f".tmp-trash-{name}-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
        if name in self.index["checkpoints"]:
            self.index["checkpoints"].remove(name)
        self.index["checkpoints"].append(name)
        self._prune()
        write_json_atomic(self.index_path, self.index)
        return final

    def track_best(self, name: str, value: float, mode: str) -> None:
        """Keep checkpoint ``name`` among the ``keep_best`` best by ``value`` ("min" or "max" is best)."""
        if not self.writes or self.keep_best <= 0 or math.isnan(value):
            return
        best = [b for b in self.index["best"] if b["name"] != name] + [{"name": name, "value": value}]
        best.sort(key=lambda b: b["value"], reverse=(mode == "max"))
        self.index["best"] = best[: self.keep_best]
        if self.index["best"] and self.index["best"][0]["name"] == name:
            _link(name, self.dir / "best")
            fsync_dir(self.dir)
        self._prune()
        write_json_atomic(self.index_path, self.index)

    def _prune(self) -> None:
        keep = set(self.index["checkpoints"][-max(1, self.keep_last):])
        keep |= {b["name"] for b in self.index["best"]}
        latest = self.dir / "latest"
        if latest.is_symlink():
            keep.add(os.readlink(latest))
        for name in list(self.index["checkpoints"]):
            if name not in keep:
                shutil.rmtree(self.dir / name, ignore_errors=True)
                self.index["checkpoints"].remove(name)


def read_checkpoint(path: Path) -> tuple[dict, dict, Optional[dict]]:
    """(state, meta, config) of a checkpoint directory; weights are read separately."""
    state = safe_torch_load(path / "state.pt") if (path / "state.pt").exists() else {}
    meta: dict = {}
    if (path / "meta.json").exists():
        try:
            meta = json.loads((path / "meta.json").read_text())
        except ValueError:
            raise CheckpointError(f"'{path / 'meta.json'}' is corrupt (not JSON)") from None
    config = None
    if (path / "config.yaml").exists():
        import yaml

        try:
            config = yaml.safe_load((path / "config.yaml").read_text())
        except yaml.YAMLError:
            raise CheckpointError(f"'{path / 'config.yaml'}' is corrupt (not YAML)") from None
    return state, meta, config
