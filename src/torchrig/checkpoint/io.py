"""Atomic, code-free checkpoint files.

Weights go to safetensors (no code can run on load); everything else (optimizer, scheduler,
counters, RNG states) is saved with ``torch.save`` and read back with ``weights_only=True``, which
refuses any pickled object that is not a tensor or a plain container. Every file is written to a
temporary name (random, created anew: a link planted in the folder is never written through), flushed
with fsync and renamed, so a process killed mid-save leaves the previous checkpoint whole. A write that
fails (a full disk, a file size limit, an I/O error) raises the ``OSError`` itself, also from inside
``torch.save``, and leaves no temporary file behind. The sha256 of the bytes written is returned, for
``meta.json``; reading a file back checks it (``open_checked``), and reads only regular files (a FIFO
would block, ``/dev/zero`` never ends).

Testing hook: ``TORCHRIG_TEST_PAUSE_AT=NAME[@K]`` in the environment, read once when this module is
imported, makes the process stop the K-th time (default: the first) a save reaches the point NAME:
it prints ``torchrig: test pause at NAME (PATH)`` on stderr and sleeps, so that a test can kill it
there. NAME is a file name (``model.safetensors``, ``state.pt``, ``config.yaml``, ``meta.json``,
``index.json``: after its bytes are in the temporary file, before the rename), a link (``latest``,
``best``: before the swap) or a step of ``CheckpointManager.save`` (``publish``: before the
temporary directory is renamed into place; ``swap``: while a re-saved step's old directory is moved
aside). It is meant for tests only.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch
from torch import nn

from .. import runtime
from ..config import files
from ..errors import TorchrigError, setting
from . import meta as meta_fields


class CheckpointError(TorchrigError, RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe or does not match the model."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that asks for code to run when read; torchrig refuses to read it."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (full disk, I/O error, ...); the previous checkpoint is untouched."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file whose bytes are not the ones written: its checksum does not match meta.json's."""


def refused(path: str | Path, what: str) -> UnsafeCheckpointError:
    """The one message for every file refused as unsafe; ``what`` says what it asks for."""
    return UnsafeCheckpointError(
        f"checkpoint file '{path}' was refused as unsafe: it {what}, which is not plain data (tensors, numbers, "
        f"strings, lists, dicts); torchrig never runs code from a checkpoint. Use a checkpoint torchrig wrote, "
        f"or re-save the file as a plain state_dict or safetensors")


def corrupt(path: str | Path, detail: str) -> CheckpointError:
    """The one message for a checkpoint file that cannot be read: damaged, cut short or empty."""
    return CheckpointError(f"checkpoint file '{path}' is corrupt or truncated ({detail}); use another checkpoint")


def weights_only_refusal(path: str | Path, exc: pickle.UnpicklingError,
                         pickled: Optional[bytes] = None) -> CheckpointError:
    """``refused`` for a file that ``torch.load(weights_only=True)`` rejected with ``exc``, or ``corrupt``.

    Unsafe means that the pickle asks for a function or class to be imported: the loader says so
    (``GLOBAL posix.system``), or ``pickled`` (the file's pickle, when given) names one outside the
    plain-data modules. A pickle that names none and still fails is damaged (a flipped bit, a cut): corrupt.
    """
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    lines = [ln.strip() for ln in text.split("WeightsUnpickler error:")[-1].splitlines() if ln.strip()]
    detail = lines[0][:200] if lines else "no reason given"
    if found:
        return refused(path, f"pickles '{found.group(1)}'")
    if pickled is None:
        return refused(path, f"holds pickled data that torch's weights_only loader rejects ({detail})")
    foreign = [name for name in _pickled_globals(pickled) if name.partition(".")[0] not in _PLAIN_MODULES]
    if foreign:
        return refused(path, f"pickles '{foreign[0]}'")
    return corrupt(path, f"its pickled data cannot be read: {detail}")


_PLAIN_MODULES = ("torch", "collections", "builtins", "__builtin__", "_codecs", "numpy")


def _pickled_globals(data: bytes) -> list[str]:
    """``module.name`` of every global a pickle imports (GLOBAL, STACK_GLOBAL, INST), as far as it parses."""
    import pickletools

    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # a damaged pickle: what parsed so far is what it asks for
        pass
    return names


def _pickle_of(path: Path) -> bytes:
    """The pickle inside a ``torch.save`` zip file (``*/data.pkl``), or the file itself (the legacy format)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            return z.read(name) if name else b""
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError):
        with open(path, "rb") as fh:
            return fh.read(1 << 20)


def _pause_spec() -> tuple[str, int]:
    name, _, nth = os.environ.get("TORCHRIG_TEST_PAUSE_AT", "").partition("@")
    return name, int(nth) if nth.isdigit() else 1


_PAUSE_AT = _pause_spec()  # testing hook (see the module docstring); ("", 1) when unset
_pause_counts: dict[str, int] = {}


def pause_point(name: str, path: Path) -> None:
    """Stop here for good if the testing hook names this point (a test then kills the process)."""
    if name != _PAUSE_AT[0]:
        return
    _pause_counts[name] = _pause_counts.get(name, 0) + 1
    if _pause_counts[name] == _PAUSE_AT[1]:
        print(f"torchrig: test pause at {name} ({path})", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Writer:
    """What checkpoint files are written through: it hashes the bytes on their way to the file (so the
    checksum is that of the bytes written, computed once, on the thread that writes), and keeps the
    ``OSError`` a write raised: ``torch.save`` turns it into a RuntimeError ("unexpected pos") that no
    longer says the disk is full."""

    def __init__(self, fh) -> None:
        self.fh = fh
        self.hash = hashlib.sha256()
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            n = self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.hash.update(data)
        return n

    def flush(self) -> None:
        self.fh.flush()


def _write_atomic(path: Path, write, root: Optional[Path] = None) -> str:
    """Write ``path`` through ``write(file)`` with ``files.atomic_file`` (a new temporary file with a random
    name, never a link followed, fsync, rename); returns its checksum."""
    with files.atomic_file(path, root) as fh:
        out = _Writer(fh)
        try:
            write(out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise
        fh.flush()
        pause_point(path.name, Path(fh.name))
    return f"{CHECKSUM}:{out.hash.hexdigest()}"


def write_bytes_atomic(path: Path, data: bytes, root: Optional[Path] = None) -> str:
    """``path`` holds ``data`` (its folder, and with ``root`` every folder below ``root``, a real folder, not a
    link); returns the checksum."""
    return _write_atomic(Path(path), lambda out: out.write(data), root)


def write_json_atomic(path: Path, obj: Any, root: Optional[Path] = None) -> str:
    return write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode(), root)


# ----------------------------------------------------------------------------- reading, checked

# Every file of a checkpoint but meta.json has its checksum in meta.json ("checksums": {"state.pt":
# "sha256:...", "sharded/__0_0.distcp": ...}), recorded from the bytes as they were written. A file is
# checked when it is opened for reading, whichever way it is loaded (resume, evaluate, predict,
# load_weights, model.weights). A file of a checkpoint folder without its record (meta.json deleted, its
# checksums damaged, or saved before they were recorded) is refused: loading it would turn the check off
# silently. ``verify=False`` (the config key ``checkpoint.verify``) loads without checking, said on each load.
CHECKSUM = "sha256"  # hashlib's, with the CPU's SHA instructions where it has them
_OTHER_CHECKPOINT = "use another checkpoint (RUN_DIR/checkpoints/)"  # what to do about a bad checkpoint file
_CHUNK = 1 << 20
LINK_LIMIT = 4096  # a `latest` / `best` link in its text-file form


def file_checksum(fh: BinaryIO) -> str:
    """``sha256:HEX`` of what is left to read in ``fh``."""
    h, buf = hashlib.sha256(), bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = fh.readinto(buf)
        if not n:
            return f"{CHECKSUM}:{h.hexdigest()}"
        h.update(view[:n])


def read_meta(checkpoint: Path) -> dict:
    """A checkpoint's ``meta.json`` ({} when it has none): a regular file of at most 16 MiB of JSON, each field
    a load uses checked by its rule (``meta.check_fields``)."""
    path = Path(checkpoint) / "meta.json"
    if not path.exists():
        return {}
    try:
        meta = json.loads(files.read_regular(path, files.JSON_LIMIT, "checkpoint file", _OTHER_CHECKPOINT,
                                             CheckpointError))
    except RecursionError:
        raise CheckpointError(f"'{path}' nests lists or mappings too deeply to be read: it is not the meta.json of a "
                              f"checkpoint torchrig wrote; {_OTHER_CHECKPOINT}") from None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise CheckpointError(f"'{path}' is corrupt (not JSON); {_OTHER_CHECKPOINT}")
    try:
        meta_fields.check_fields(meta)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint file '{path}': {exc}; {_OTHER_CHECKPOINT}") from None
    return meta


CHECKPOINT_FILES = ("meta.json", "state.pt", "config.yaml", "sharded")  # beside the weights: a torchrig checkpoint


def checkpoint_of(path: Path) -> Optional[tuple[Path, str]]:
    """``(checkpoint folder, the file's name in its checksums)`` for a file of a torchrig checkpoint (a folder
    holding ``meta.json``, ``state.pt``, ``config.yaml`` or ``sharded/`` beside it; DCP's files one folder down);
    None for a file elsewhere, such as a weights file of the user's own."""
    path = Path(path)
    folder, name = path.parent, path.name
    if folder.name == "sharded":
        folder, name = folder.parent, f"sharded/{name}"
    if any(os.path.lexists(folder / other) for other in CHECKPOINT_FILES):
        return folder, name
    return None


def recorded_checksum(path: Path, verify: bool = True) -> Optional[str]:
    """The checksum ``meta.json`` of ``path``'s checkpoint recorded for it; None for a file that is not part
    of a checkpoint, or with ``verify=False``. A checkpoint's file without its record is refused."""
    found = checkpoint_of(Path(path)) if verify else None
    if found is None:
        return None
    folder, name = found
    meta = read_meta(folder)
    if "checksums" not in meta:
        held = "has no meta.json" if not (folder / "meta.json").exists() else "records no checksums in its meta.json"
        raise _unrecorded(folder, f"{held}, so its files cannot be checked against the checksums recorded when "
                                  f"they were saved")
    try:
        sums = meta_fields.check_checksums(meta["checksums"])
    except ValueError as exc:
        raise _unrecorded(folder, f"has a damaged checksum record: meta.json's {exc}") from None
    if name not in sums:
        raise _unrecorded(folder, f"records no checksum for its file '{name}' in its meta.json, so that file cannot "
                                  f"be checked")
    return sums[name]


def _unrecorded(folder: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint '{folder}' {why}; {_OTHER_CHECKPOINT}, or load it unchecked with "
                           f"{setting('checkpoint.verify', False)}")


def say_unverified(path: Path) -> None:
    """The line each load with ``checkpoint.verify=false`` prints (on stderr, once per process group)."""
    if runtime.get_rank() == 0:
        print(f"torchrig: checkpoint.verify=false: '{path}' is loaded without checking its files against the "
              f"checksums in its meta.json", file=sys.stderr, flush=True)


def _corrupt(path: Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint file '{path}' is corrupt: its bytes do not match the {CHECKSUM} checksum recorded in "
        f"meta.json when it was saved; {_OTHER_CHECKPOINT}, or retrain")


def open_checked(path: Path, verify: bool = True) -> BinaryIO:
    """``path`` opened for reading, at its start: a regular file whose bytes match the checksum its
    checkpoint recorded (one pass over the file; the caller's read then comes from the page cache)."""
    path = Path(path)
    expected = recorded_checksum(path, verify)
    fh = files.open_regular(path, "checkpoint file", _OTHER_CHECKPOINT, CheckpointError)
    try:
        if expected is not None:
            if file_checksum(fh) != expected:
                raise _corrupt(path)
            fh.seek(0)
        return fh
    except BaseException:
        fh.close()
        raise


def read_checked(path: Path, limit: int, verify: bool = True) -> bytes:
    """The bytes of a small checkpoint file (at most ``limit``), checked against its recorded checksum."""
    path = Path(path)
    expected = recorded_checksum(path, verify)
    data = files.read_regular(path, limit, "checkpoint file", _OTHER_CHECKPOINT, CheckpointError)
    if expected is not None and f"{CHECKSUM}:{hashlib.sha256(data).hexdigest()}" != expected:
        raise _corrupt(path)
    return data


def _plain_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, with shared storage (tied weights) duplicated so safetensors accepts it."""
    out: dict[str, torch.Tensor] = {}
    seen: set = set()
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"state_dict entry '{key}' is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if hasattr(t, "full_tensor"):  # DTensor (FSDP2): gather to a plain tensor
            t = t.full_tensor()
        t = t.to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a bigger storage
        out[key] = t
    return out


def save_weights(state: dict[str, torch.Tensor], path: Path) -> str:
    from safetensors.torch import save

    data = save(_plain_tensors(state), metadata={"format": "pt", "writer": "torchrig"})
    return write_bytes_atomic(Path(path), data)


def load_weights_file(path: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint (its folder: ``model.safetensors``) or of a weights file (safetensors, or a
    plain state_dict in a ``.pt``), checked against its checkpoint's record (see ``recorded_checksum``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.exists():
        raise CheckpointError(f"weights file '{path}' does not exist; point at a checkpoint directory or a .safetensors file")
    if path.suffix in (".pt", ".pth", ".bin"):
        obj = safe_torch_load(path, verify)
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"weights file '{path}' does not hold a state_dict of tensors")
        return obj
    from safetensors.torch import load_file

    open_checked(path, verify).close()  # a regular file with the bytes that were saved (safetensors reads by name)
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"weights file '{path}' is corrupt or not a safetensors file ({exc}); "
                              f"use another checkpoint (RUN_DIR/checkpoints/) or retrain") from None


def check_keys(saved: set, expected: set, source: str) -> None:
    """Raise a CheckpointError listing missing and unexpected keys, if any."""
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        def show(keys: list) -> str:
            return ", ".join(keys[:8]) + (f" … ({len(keys)} in all)" if len(keys) > 8 else "") if keys else "none"
        raise CheckpointError(f"{source} does not match the model: missing keys: {show(missing)}; "
                              f"unexpected keys: {show(unexpected)}. Was it saved from a different model or config?")


def frozen_keys(model: nn.Module) -> set[str]:
    """The ``state_dict`` keys of ``model``'s frozen parameters (``requires_grad=False``)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without its frozen parameters: what an adapted model's checkpoint holds (its buffers
    stay: a frozen model's running statistics still change)."""
    frozen = frozen_keys(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def load_into(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint",
              frozen_kept: bool = False) -> None:
    """``model.load_state_dict`` with a message that lists missing and unexpected keys. ``frozen_kept``: ``state``
    holds what trains (:func:`trainable_state`) and the frozen parameters keep their values (a checkpoint of
    adapters, whose base the caller has checked is this model's)."""
    got = set(state.keys())
    own = trainable_state(model) if frozen_kept else model.state_dict()
    check_keys(got, set(own), source)
    bad = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in sorted(got)
           if state[k].shape != own[k].shape]
    if bad:
        raise CheckpointError(f"{source} does not match the model: shape mismatch for " + "; ".join(bad[:5]))
    model.load_state_dict(state, strict=not frozen_kept)


def safe_torch_save(obj: Any, path: Path) -> str:
    return _write_atomic(Path(path), lambda out: torch.save(obj, out))


def safe_torch_load(path: Path, verify: bool = True) -> Any:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file '{path}' does not exist")
    with files.open_regular(path, "checkpoint file", _OTHER_CHECKPOINT, CheckpointError) as fh:  # no FIFO, no device
        if os.fstat(fh.fileno()).st_size == 0:
            raise corrupt(path, "it is empty, 0 bytes")
    try:
        with open_checked(path, verify) as fh:  # its checksum checked in the same pass
            return torch.load(fh, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise weights_only_refusal(path, exc, _pickle_of(path)) from None
    except MemoryError:
        raise
    except Exception as exc:  # a damaged file makes the loader fail in any way: a zip error, a bad tensor record …
        text = str(exc).strip()
        raise corrupt(path, f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__) \
            from None
