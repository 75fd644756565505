"""Checkpoint directories in ``RUN_DIR/checkpoints``: atomic save, keep-last-k, best-k, ``latest``.

A checkpoint is a directory ``step-00000123`` holding ``model.safetensors``, ``state.pt``
(optimizers, schedulers, scaler, counters, RNG states), ``config.yaml`` and ``meta.json`` (written
last: step, epoch, ... and the sha256 of every other file, checked whenever one is read). It is
written under a temporary name and renamed into place, then ``latest`` (a symbolic link) is
swapped atomically; so ``latest`` always names a complete checkpoint. A save that fails (a full
disk, an I/O error) removes what it wrote and leaves ``latest`` on the previous checkpoint; what a
killed save leaves behind is finished or removed by ``clean_partial`` at the next start. With
``async_save`` all of this runs on one background thread after ``save`` has copied the state to host
memory (see ``background``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..config.files import (JSON_LIMIT, YAML_LIMIT, UnsafePathError, make_dir, make_temp_dir, parse_yaml, read_regular,
                            replace_link)
from ..errors import setting
from .background import BackgroundWriter, host_copy
from .layout import PREFIX, checkpoint_name, weight_files
from .io import (LINK_LIMIT, CheckpointError, CheckpointWriteError, file_checksum, fsync_dir, load_into,
                 load_weights_file, pause_point, read_checked, read_meta, refused, safe_torch_load, safe_torch_save,
                 save_weights, say_unverified, trainable_state, write_bytes_atomic, write_json_atomic)

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _link(target_name: str, link: Path) -> None:
    replace_link(target_name, link, before=lambda tmp: pause_point(link.name, tmp))


def _is_temporary(name: str) -> bool:
    """The names saves write under before renaming (each ending in random hex digits): ``.tmp-step-*``,
    ``.tmp-staged-*``, ``.tmp-trash-*``, ``.index.json.tmp-*``, ``.latest.tmp-*``, ..."""
    return name.startswith(".") and ".tmp-" in name


def _os_error(exc: BaseException) -> Optional[OSError]:
    """The OSError behind ``exc``: itself, what it was raised from, or a failure DCP gathered from a rank."""
    for _ in range(8):
        if exc is None or isinstance(exc, OSError):
            return exc
        for failure in getattr(exc, "failures", {}).values():  # DCP's CheckpointException: rank -> (exc, trace)
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, OSError):
                return inner
        exc = exc.__cause__
    return None


def _write_failure(error: OSError, step: int, where: Path, previous: Optional[int], published: bool) -> str:
    code = errno.errorcode.get(error.errno, "") if error.errno else ""
    if error.errno in _NO_SPACE:
        what = "no space left on device" + ("" if error.errno == errno.ENOSPC else f" ({code}: {error.strerror})")
        todo = "Free some space"
    else:
        what = f"OS error {code} ({error.strerror})" if code else f"OS error ({error})"
        todo = "Fix the storage"
    if published:
        kept = f"checkpoint step {step} itself is complete and 'latest' names it; only index.json or the 'best' " \
               f"link may be out of date"
    elif previous is None:
        kept = "there is no previous checkpoint"
    else:
        kept = f"the previous checkpoint (step {previous}) is intact"
    return f"{what} while saving checkpoint step {step} to {where}; {kept}. {todo} and continue with " \
           f"{setting('resume', 'latest')}"


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
            raise CheckpointError(f"'{path}' names a checkpoint of a run directory: give RUN_DIR/checkpoints/{path}, "
                                  f"or run_dir with resume={path!r}")
        link = Path(run_dir) / "checkpoints" / str(path)
        if not (link.exists() or link.is_symlink()):
            return None
        p = link
    if p.is_dir() and (p / "checkpoints").is_dir() and not (p / "model.safetensors").exists():
        return resolve("latest", p)  # a run directory
    if p.is_dir() and (p / "last").is_dir() and not (p / "checkpoints").exists():
        return resolve(follow_link(p / "last"), run_dir)  # the folder of numbered runs: its newest run
    if p.name in ("latest", "best"):
        p = follow_link(p)
    elif p.is_symlink():
        p = p.resolve()
    if not p.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist; give a checkpoint directory "
                              f"(RUN_DIR/checkpoints/step-N, .../latest, .../best) or a run directory")
    if p.is_file() and p.name == "model.safetensors":
        p = p.parent
    if not (p / "model.safetensors").exists():
        raise CheckpointError(f"'{p}' is not a torchrig checkpoint (no model.safetensors inside)")
    return p


def follow_link(link: Path) -> Path:
    """What a ``latest`` / ``best`` link (a symlink, or a text file naming a checkpoint) or the ``last`` link
    of numbered runs names, if it lies beside the link: a link elsewhere would make a resume read files of
    another run, or a run write into a folder it does not own."""
    if link.is_symlink():
        target = link.resolve()
    elif link.exists() and not link.is_dir():  # the text-file form (a file system without symbolic links)
        text = read_regular(link, LINK_LIMIT, "checkpoint link",
                            "remove it, or give the checkpoint directory itself", CheckpointError)
        target = (link.parent / text.decode(errors="replace").strip()).resolve()
    else:
        return link
    if target.parent != link.parent.resolve():
        what = "run" if link.name == "last" else "checkpoint"
        raise CheckpointError(f"{what} link '{link}' points outside its folder, to '{target}'; torchrig follows "
                              f"'{link.name}' only to a {what} in the same folder. Remove the link, or give the "
                              f"{what} directory itself")
    return target


class CheckpointManager:
    """The checkpoints of one run directory: ``{name: Stateful}`` mappings saved and loaded whole.

    ``save(step, states)`` / ``load(path, states)`` take the same mapping: ``"model"`` (an
    ``nn.Module``), ``"optimizers"`` (name -> optimizer) and any other objects with ``state_dict`` /
    ``load_state_dict``. The model goes to ``model.safetensors``, everything else to ``state.pt``;
    with ``sharded=True`` (FSDP2) model and optimizer shards go to ``sharded/`` through DCP as well.
    Several ranks: every rank calls ``save`` (some ``state_dict`` calls are collectives); only the
    one with ``writes=True`` writes, except the shards, which every rank writes. An object with a
    ``weights_file`` attribute (the EMA of the weights) also has its ``weights()`` written to that
    safetensors file, and read back with ``load_weights``.

    With ``async_save=True`` ``save`` copies the state to host memory and returns; a background
    thread writes it (see ``background``; sharded: DCP's ``async_save`` on every rank). ``wait()``
    blocks until it is written and raises its error, if any; the next ``save`` and ``close()`` wait too.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 2, keep_best: int = 1, *, writes: bool = True,
                 sharded: bool = False, async_save: bool = False, pipeline: Any = None, trainable_only: bool = False):
        self.dir = Path(run_dir) / "checkpoints"
        self.trainable_only = trainable_only  # the model's frozen parameters are not saved (an adapted model's base)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.writes, self.sharded = writes, sharded
        self.pipeline = pipeline  # the group of this rank's pipeline (parallel.pp): each stage saves its own part
        self.async_save = async_save
        self._background = BackgroundWriter() if async_save and writes else None
        self.shard_job: Optional[tuple[int, Any]] = None  # sharded, ranks > 0: (step, DCP's future) in flight
        self._group: Any = None  # sharded + async: the gloo group DCP's background writes use
        self.last_step: Optional[int] = None  # the newest checkpoint this process saved or resumed from
        self.index_path = self.dir / "index.json"
        self.index: dict[str, Any] = {"checkpoints": [], "best": []}
        self._yaml: tuple[Optional[str], bytes] = (None, b"")  # the last config (as JSON) and its YAML
        if self.index_path.exists():
            try:
                self.index = _plain_index(json.loads(read_regular(
                    self.index_path, JSON_LIMIT, "checkpoint index",
                    "remove it (it is rebuilt from the checkpoints beside it)", CheckpointError)))
            except (OSError, ValueError, RecursionError):  # a cache: rebuilt from the checkpoints' names
                self.index = {"checkpoints": self._scan(), "best": []}

    def _scan(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob(f"{PREFIX}*") if (p / "model.safetensors").exists())

    def clean_partial(self) -> None:
        """Finish or remove what a save cut short left behind: run on rank 0 at every start.

        A re-save stopped while ``latest`` named its complete temporary directory is finished; every
        other temporary directory or file is removed. A link (or a file) in the place of the folder is refused
        (``UnsafePathError``): nothing is removed or written through it.
        """
        if not (self.dir.exists() or self.dir.is_symlink()):
            return
        make_dir(self.dir)
        self._finish_swap()
        latest = self.dir / "latest"
        keep = os.readlink(latest) if latest.is_symlink() else None
        for p in self.dir.iterdir():
            if _is_temporary(p.name) and p.name != keep:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def _finish_swap(self) -> None:
        latest = self.dir / "latest"
        target = os.readlink(latest) if latest.is_symlink() else ""
        found = re.fullmatch(r"\.tmp-(step-\d+)-[0-9a-f]+", target)
        if found is None or not (self.dir / target).is_dir():
            return
        final = self.dir / found.group(1)
        if final.exists():
            os.replace(final, make_temp_dir(self.dir, f".tmp-trash-{found.group(1)}-"))
        os.replace(self.dir / target, final)
        fsync_dir(self.dir)
        _link(final.name, latest)
        fsync_dir(self.dir)

    def latest_step(self) -> Optional[int]:
        """The step ``latest`` names, or None."""
        try:
            found = re.search(r"step-(\d+)", os.readlink(self.dir / "latest"))
        except OSError:
            return None
        return int(found.group(1)) if found else None

    # -- Stateful objects ---------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, Any], *, config: Optional[dict], meta: dict,
             metrics: Optional[dict] = None) -> Optional[Path]:
        """Checkpoint ``step`` of ``states``; its directory (None on ranks that write no directory)."""
        self.wait()  # at most one save in flight; its error, if any, is raised here
        model, optimizers = states["model"], states["optimizers"]
        others = {k: v for k, v in states.items() if k not in ("model", "optimizers")}
        if self.sharded:
            from . import sharded

            path = sharded.save(self, step, model, optimizers, others, config, meta, metrics)
        else:
            state = {k: v.state_dict() for k, v in others.items()}  # on every rank: some are collectives
            state["optimizers"] = {k: o.state_dict() for k, o in optimizers.items()}
            path = None
            weights = trainable_state(model) if self.trainable_only else model.state_dict()
            if self.writes and self._background is not None:
                weights, state, files, metrics = host_copy((weights, state, weight_files(others), metrics))
                self.submit(self.write, step, weights, state, config, meta, metrics, files=files)
                path = self.dir / checkpoint_name(step)  # once written; `wait()` to be sure
            elif self.writes:
                path = self.write(step, weights, state, config, meta, metrics, files=weight_files(others))
        self.last_step = step
        return path

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn`` on the writer thread (after what is queued), or now without asynchronous saves."""
        if self._background is None:
            fn(*args, **kwargs)
        else:
            self._background.submit(fn, *args, **kwargs)

    def wait(self) -> None:
        """Block until the save in flight (with asynchronous saves) is written; raise its error, if any."""
        if self._background is not None:
            self._background.wait()
        if self.shard_job is not None:
            (step, job), self.shard_job = self.shard_job, None
            try:
                job.result()
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise CheckpointWriteError(f"writing this rank's shards of checkpoint step {step} to {self.dir} "
                                           f"failed ({first}); rank 0's message says what was kept") from exc

    def checkpoint_group(self) -> Any:
        """A gloo process group for background checkpoint collectives (made on first use: every rank calls it)."""
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def close(self) -> None:
        """Wait for the save in flight and stop the background writer."""
        try:
            if self._background is not None:
                self._background.close()
            self.wait()
        finally:
            if self._group is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group(self._group)
                self._group = None

    def load(self, path: Path, states: dict[str, Any], print_fn: Callable[[str], None] = print,
             verify: bool = True) -> dict:
        """Restore ``states`` from checkpoint ``path`` exactly, or raise; returns its meta. ``verify=False``
        (``checkpoint.verify``) loads files without their checksum record unchecked, and says so."""
        if not verify:
            say_unverified(path)
        if not (path / "state.pt").exists():
            raise CheckpointError(f"checkpoint '{path}' has no training state (state.pt), so it cannot resume "
                                  f"exactly; set resume_weights_only=true to load its weights and start a fresh "
                                  f"optimizer and schedule, or resume from another checkpoint")
        state, meta, _ = read_checkpoint(path, verify)
        missing = [k for k in ("counters", "rng", "optimizers") if k not in state]
        if missing:
            raise CheckpointError(f"checkpoint '{path}' state.pt lacks {', '.join(missing)}, so it cannot resume "
                                  f"exactly; set resume_weights_only=true to load its weights only")
        model, optimizers = states["model"], states["optimizers"]
        sharded_dir = self.sharded or (path / "sharded").exists()  # its optimizers live in sharded/, checked there
        lost = [] if sharded_dir else [k for k in optimizers if k not in state["optimizers"]]
        if lost:  # loading the others would leave this one fresh (no momentum, no Adam moments): not exact
            raise CheckpointError(f"checkpoint '{path}' state.pt lacks the state of optimizer "
                                  f"{', '.join(repr(k) for k in lost)}, so it cannot resume exactly; set "
                                  f"resume_weights_only=true to load its weights only")
        frozen_kept = meta.get("weights") == "trainable"  # a checkpoint of what trains: the base stays as it is
        if sharded_dir:
            from . import sharded

            sharded.load(model, optimizers, path, print_fn, verify, self.pipeline, frozen_kept)
        else:
            load_into(model, load_weights_file(path, verify), source=f"checkpoint '{path}'", frozen_kept=frozen_kept)
        for obj in states.values():  # e.g. the EMA: None when the checkpoint has no such file
            if hasattr(obj, "weights_file"):
                obj.load_weights(load_weights_file(path / obj.weights_file, verify)
                                 if (path / obj.weights_file).exists() else None)
        try:
            full_into_shards = self.sharded and not (path / "sharded").exists()  # a plain checkpoint into FSDP2
            for k, opt in optimizers.items():
                if k in state["optimizers"] and full_into_shards:
                    from .sharded import load_full_optimizer

                    load_full_optimizer(model, opt, state["optimizers"][k])
                elif k in state["optimizers"]:
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
              metrics: Optional[dict] = None, extra_writer: Optional[Callable[[Path], None]] = None,
              files: Optional[dict[str, dict]] = None) -> Path:
        """Write checkpoint directory ``step`` atomically and point ``latest`` at it.

        Any write error (full disk, file size limit, I/O error) removes what this save wrote and raises a
        one-line CheckpointWriteError; ``latest`` keeps naming the previous checkpoint.
        """
        name = checkpoint_name(step)
        previous, published = self.latest_step(), False
        try:
            make_dir(self.dir)
            tmp = make_temp_dir(self.dir, f".tmp-{name}-")
            self._write(tmp, weights, state, config, dict(meta, metrics=metrics or {}, saved_at=time.time()),
                        extra_writer, files or {})
            final = self._publish(tmp, name)
            published = True
            self._record(name)
        except BaseException as exc:
            try:
                self.clean_partial()
            except OSError:
                pass  # the storage is failing: what is left is removed at the next start
            error = _os_error(exc)
            if error is None or isinstance(error, UnsafePathError):
                raise
            raise CheckpointWriteError(_write_failure(error, step, self.dir, previous, published)) from exc
        return final

    def _write(self, tmp: Path, weights: Optional[dict], state: dict, config: Optional[dict], meta: dict,
               extra_writer: Optional[Callable[[Path], None]], files: dict[str, dict]) -> None:
        sums = {}  # file -> checksum of the bytes written, kept in meta.json (written last)
        if weights is not None:
            sums["model.safetensors"] = save_weights(weights, tmp / "model.safetensors")
        for name, tensors in files.items():
            sums[name] = save_weights(tensors, tmp / name)
        sums["state.pt"] = safe_torch_save(state, tmp / "state.pt")
        if config is not None:
            sums["config.yaml"] = write_bytes_atomic(tmp / "config.yaml", self._config_yaml(config))
        if extra_writer is not None:
            extra_writer(tmp)
            for f in sorted(tmp.rglob("*")):  # what it wrote (DCP's shards): read back once to hash them
                name = f.relative_to(tmp).as_posix()
                if name not in sums and f.is_file() and not f.is_symlink():
                    with open(f, "rb") as fh:
                        sums[name] = file_checksum(fh)
        write_json_atomic(tmp / "meta.json", dict(meta, checksums=sums))
        fsync_dir(tmp)

    def _config_yaml(self, config: dict) -> bytes:
        """``config`` as YAML; the same config as the previous save's reuses its text (PyYAML's pure-Python
        emitter takes milliseconds for a full config, held against the training thread under async saves)."""
        key = json.dumps(config, sort_keys=True, default=str)  # a value, not the dict: a caller may change it
        if self._yaml[0] != key:
            import yaml

            self._yaml = (key, yaml.safe_dump(config, sort_keys=False).encode())
        return self._yaml[1]

    def _publish(self, tmp: Path, name: str) -> Path:
        """Rename the complete ``tmp`` into place and point ``latest`` at it, whole at every instant."""
        final = self.dir / name
        trash = None
        if final.exists():  # re-saving a step (epoch end, resumed run): `latest` must name a whole
            _link(tmp.name, self.dir / "latest")  # checkpoint at every instant, so it names tmp meanwhile
            fsync_dir(self.dir)
            staged = make_temp_dir(self.dir, f".tmp-staged-{name}-")
            shutil.copytree(tmp, staged, copy_function=_hardlink_or_copy, dirs_exist_ok=True)
            fsync_dir(staged)
            trash = make_temp_dir(self.dir, f".tmp-trash-{name}-")
            os.replace(final, trash)  # over the new empty folder
            pause_point("swap", final)
            os.replace(staged, final)
        else:
            pause_point("publish", final)
            os.replace(tmp, final)
        fsync_dir(self.dir)
        _link(name, self.dir / "latest")
        fsync_dir(self.dir)
        for leftover in (tmp, trash):
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)
        return final

    def _record(self, name: str) -> None:
        if name in self.index["checkpoints"]:
            self.index["checkpoints"].remove(name)
        self.index["checkpoints"].append(name)
        self._prune()
        write_json_atomic(self.index_path, self.index)

    def track_best(self, name: str, value: float, mode: str, loss: Optional[float] = None) -> None:
        """Keep checkpoint ``name`` among the ``keep_best`` best by ``value`` ("min" or "max" is best); a tie goes
        to the lower ``loss`` (the split's loss, when the value is another metric), then to the later step."""
        if not self.writes or self.keep_best <= 0 or math.isnan(value):
            return
        self.submit(self._track_best, name, value, mode, loss)  # with async saves: after the save of `name`

    def _track_best(self, name: str, value: float, mode: str, loss: Optional[float] = None) -> None:
        entry = {"name": name, "value": value, **({"loss": loss} if _number(loss) else {})}
        best = [b for b in self.index["best"] if b["name"] != name] + [entry]
        best.sort(key=lambda b: _best_rank(b, mode))
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


def _best_rank(entry: dict, mode: str) -> tuple[float, float, int]:
    """The sort key of a best-checkpoint entry, best first: its value, then its loss (none ranks last),
    then the later step."""
    loss = entry.get("loss", math.inf)
    return (entry["value"] if mode == "min" else -entry["value"], loss, -int(entry["name"][len(PREFIX):]))


def _plain_index(index: Any) -> dict[str, Any]:
    """``index.json`` as torchrig writes it, or ValueError. Only names of checkpoints (``step-N``) are kept:
    pruning removes the directories it names, and a crafted ``../../x`` or ``/home/x`` must never be one."""
    if not isinstance(index, dict):
        raise ValueError("not a mapping")
    names = [n for n in index.get("checkpoints") or [] if isinstance(n, str) and re.fullmatch(r"step-\d+", n)]
    best = [{"name": b["name"], "value": float(b["value"]),
             **({"loss": float(b["loss"])} if _number(b.get("loss")) else {})}
            for b in index.get("best") or [] if isinstance(b, dict) and isinstance(b.get("name"), str)
            and re.fullmatch(r"step-\d+", b["name"]) and _number(b.get("value"))]
    return {"checkpoints": names, "best": best}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def read_checkpoint(path: Path, verify: bool = True) -> tuple[dict, dict, Optional[dict]]:
    """(state, meta, config) of a checkpoint directory; weights are read separately."""
    meta = read_meta(path)  # first: its fields (and its checksums, as each file is read) say what else is read
    state = safe_torch_load(path / "state.pt", verify) if (path / "state.pt").exists() else {}
    return state, meta, read_config(path, verify)


def read_config(path: Path, verify: bool = True) -> Optional[dict]:
    """The ``config.yaml`` of checkpoint ``path`` (None when it has none): YAML with safe tags only,
    aliases bounded (see ``config.files``), checked against its recorded checksum."""
    import yaml

    file = Path(path) / "config.yaml"
    if not file.exists():
        return None
    try:
        text = read_checked(file, YAML_LIMIT, verify).decode("utf-8")
        return parse_yaml(text, str(file), "checkpoint file", CheckpointError, yaml12_floats=False)
    except yaml.constructor.ConstructorError as exc:  # a tag safe_load does not build, e.g. !!python/object
        tag = re.search(r"tag '([^']+)'", str(exc.problem))
        raise refused(file, f"uses the YAML tag '{tag.group(1) if tag else exc.problem}'") from None
    except (yaml.YAMLError, UnicodeDecodeError):
        raise CheckpointError(f"'{file}' is corrupt (not YAML)") from None
