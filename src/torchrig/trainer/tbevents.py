"""TensorBoard event files, written by torchrig itself.

An event file is a sequence of TFRecords, each holding one ``Event`` protocol buffer. Writing them
takes a few lines of byte packing, so torchrig imports neither ``tensorboard``, nor
``torch.utils.tensorboard``, nor ``google.protobuf`` (~0.15 s at every start), and runs no writer
thread: a logged row is encoded, checksummed and written by the caller, once per row. The
``tensorboard`` package is only needed to view the files.

A TFRecord: the data's length (uint64, little-endian), the masked CRC-32C of those 8 bytes (uint32),
the data, the masked CRC-32C of the data. The messages (field numbers of TensorBoard's
``event.proto``, ``summary.proto``, ``tensor.proto``, ``tensor_shape.proto``, the hparams plugin's
``api.proto`` / ``plugin_data.proto`` and protobuf's ``struct.proto``; every one proto3, so a field
at its default value is left out, except the members of a ``oneof``)::

    Event            wall_time=1 double, step=2 int64, file_version=3 string, summary=5,
                     session_log=7 (SessionLog: status=1, START=1)
    Summary          value=1 (repeated Summary.Value)
    Summary.Value    tag=1, simple_value=2 float, tensor=8 TensorProto, metadata=9 SummaryMetadata
    SummaryMetadata  plugin_data=1 (PluginData: plugin_name=1, content=2 bytes)
    TensorProto      dtype=1 (DT_STRING=7), tensor_shape=2 (dim=2: size=1), string_val=8
    HParamsPluginData  version=1, experiment=2, session_start_info=3, session_end_info=4
    Experiment       hparam_infos=4 (HParamInfo: name=1, type=4: STRING=1, BOOL=2, FLOAT64=3)
    SessionStartInfo hparams=1 (map<string, google.protobuf.Value>: key=1, value=2)
    SessionEndInfo   status=1 (STATUS_SUCCESS=1)
    protobuf Value   number_value=2 double, string_value=3, bool_value=4
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Optional

# -- CRC-32C (Castagnoli) ------------------------------------------------------------------------

_POLY = 0x82F63B78  # reflected


def _tables() -> tuple[list[int], ...]:
    """Four 256-entry tables: CRC-32C four bytes at a time ("slicing by 4"), ~1.5x a byte at a time."""
    first = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        first.append(c)
    tables = [first]
    for _ in range(3):
        tables.append([(c >> 8) ^ first[c & 0xFF] for c in tables[-1]])
    return tuple(tables)


_T0, _T1, _T2, _T3 = _tables()


def crc32c(data: bytes) -> int:
    """The CRC-32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``)."""
    t0, t1, t2, t3 = _T0, _T1, _T2, _T3
    crc = 0xFFFFFFFF
    whole = len(data) & ~3
    for (w,) in struct.iter_unpack("<I", data[:whole]):
        w ^= crc
        crc = t3[w & 0xFF] ^ t2[(w >> 8) & 0xFF] ^ t1[(w >> 16) & 0xFF] ^ t0[w >> 24]
    for b in data[whole:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The checksum a TFRecord stores: the CRC rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# -- protocol buffer encoding --------------------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # a negative int64 takes ten bytes, as protobuf writes it
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _message(field: int, payload: bytes) -> bytes:
    """A length-delimited field: string, bytes or embedded message."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _text(field: int, s: str) -> bytes:
    return _message(field, s.encode("utf-8"))


def _int(field: int, n: int, always: bool = False) -> bytes:
    return _varint(field << 3) + _varint(n) if n or always else b""


def _double(field: int, x: float, always: bool = False) -> bytes:
    packed = struct.pack("<d", x)
    return _varint(field << 3 | 1) + packed if always or packed != b"\0" * 8 else b""


def _float32(x: float) -> bytes:
    """``x`` as a float32, as protobuf stores it: beyond float32's range it becomes an infinity."""
    try:
        return struct.pack("<f", x)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, x))


SESSION_START = _int(1, 1)  # SessionLog {status: START}
FILE_VERSION = "brain.Event:2"


def event(wall_time: float, step: int, file_version: Optional[str] = None, summary: Optional[bytes] = None,
          session_log: Optional[bytes] = None) -> bytes:
    """An encoded ``Event``; ``summary`` and ``session_log`` are encoded messages."""
    out = _double(1, wall_time) + _int(2, step)
    if file_version is not None:
        out += _text(3, file_version)
    if summary is not None:
        out += _message(5, summary)
    if session_log is not None:
        out += _message(7, session_log)
    return out


def _plugin_value(tag: str, plugin: str, content: bytes = b"", tensor: bytes = b"") -> bytes:
    """A ``Summary.Value`` that a TensorBoard plugin reads: tag, tensor, metadata with its plugin data."""
    plugin_data = _text(1, plugin) + (_message(2, content) if content else b"")
    return _message(1, _text(1, tag) + (_message(8, tensor) if tensor else b"")
                    + _message(9, _message(1, plugin_data)))


def text_summary(tag: str, s: str) -> bytes:
    """A ``Summary`` of the text plugin: a string tensor of shape [1] under ``TAG/text_summary``."""
    tensor = _int(1, 7) + _message(2, _message(2, _int(1, 1))) + _message(8, s.encode("utf-8"))
    return _plugin_value(f"{tag}/text_summary", "text", tensor=tensor)


HPARAMS_TAGS = ("_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info")


def hparams_summaries(params: dict[str, Any]) -> list[bytes]:
    """The three ``Summary`` messages of the hparams plugin, as ``torch.utils.tensorboard.summary.hparams``
    writes them for ``params`` and no metrics: the experiment (each name with its type), the session
    start (the values) and the session end (success). Numbers (bools among them, as there) are float64;
    ``None`` is left out; anything else must be a string."""
    infos, values = [], []
    for name, v in params.items():
        if v is None:
            continue
        if isinstance(v, (int, float)):
            kind, value = 3, _double(2, float(v), always=True)
        elif isinstance(v, str):
            kind, value = 1, _text(3, v)
        else:
            raise ValueError(f"hyperparameter {name!r}: {type(v).__name__} {v!r} is not a number or a string")
        infos.append(_message(4, _text(1, name) + _int(4, kind)))
        values.append(_message(1, _text(1, name) + _message(2, value)))
    # HParamsPluginData: version 0 (left out), then its experiment / session start / session end
    contents = (_message(2, b"".join(infos)), _message(3, b"".join(values)), _message(4, _int(1, 1)))
    return [_plugin_value(tag, "hparams", content) for tag, content in zip(HPARAMS_TAGS, contents)]


# -- the writer ----------------------------------------------------------------------------------

_files = itertools.count()  # the last part of a file name: two writers of one process and second differ


class EventWriter:
    """One new event file under ``log_dir``, named as TensorBoard names its own
    (``events.out.tfevents.<seconds>.<host>.<pid>.<n>``), so ``tensorboard --logdir`` finds it.

    ``purge_step``: a resumed run's first step. TensorBoard then hides what an earlier file logged at
    this step and after it (a ``SessionLog`` START event), as ``SummaryWriter(purge_step=...)`` does.
    Writes are synchronous; each row is flushed to the file (not fsynced), so TensorBoard shows it live.
    """

    def __init__(self, log_dir: Path | str, purge_step: Optional[int] = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path, self._fh = _new_file(self.log_dir)
        self._tags: dict[str, bytes] = {}
        now = time.time()
        self._write(event(now, 0, file_version=FILE_VERSION))
        if purge_step is not None:
            self._write(event(now, purge_step, session_log=SESSION_START))
        self.flush()

    def scalars(self, values: dict[str, float], step: int) -> None:
        """One event holding every finite value of ``values`` (stored as float32, as TensorBoard does)."""
        tags, parts = self._tags, []
        for tag, v in values.items():
            v = float(v)
            if math.isfinite(v):
                head = tags.get(tag)
                if head is None:  # Summary.value entry up to the float: length, tag, simple_value's key
                    name = _text(1, tag)
                    head = tags[tag] = b"\x0a" + _varint(len(name) + 5) + name + b"\x15"
                parts.append(head)
                parts.append(_float32(v))
        if parts:
            self._write(event(time.time(), step, summary=b"".join(parts)))
            self.flush()

    def text(self, tag: str, s: str, step: int) -> None:
        self._write(event(time.time(), step, summary=text_summary(tag, s)))
        self.flush()

    def hparams(self, params: dict[str, Any]) -> None:
        """The hyperparameters for TensorBoard's HPARAMS tab, at step 0."""
        now = time.time()
        for summary in hparams_summaries(params):
            self._write(event(now, 0, summary=summary))
        self.flush()

    def flush(self) -> None:
        if not self._fh.closed:
            try:
                self._fh.flush()
            except OSError:
                self._drop()
                raise

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def _write(self, data: bytes) -> None:
        try:
            self._fh.write(record(data))
        except OSError:
            self._drop()
            raise

    def _drop(self) -> None:
        """Close a file that failed to write; what it still buffers cannot be written either."""
        try:
            self._fh.close()
        except OSError:
            pass


def _new_file(log_dir: Path) -> tuple[Path, Any]:
    while True:
        name = "events.out.tfevents.%010d.%s.%s.%s" % (time.time(), socket.gethostname(), os.getpid(), next(_files))
        try:
            return log_dir / name, open(log_dir / name, "xb")
        except FileExistsError:
            if not log_dir.is_dir():
                raise
