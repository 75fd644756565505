"""Reading the files a run is pointed at: regular files only, small kinds of file with a size cap, and
YAML whose aliases cannot blow it up.

A path can name a FIFO (a read blocks for ever), a device (``/dev/zero`` never ends), a directory, or
a file far bigger than its kind ever is; a tiny YAML file can repeat one list through nested aliases
("billion laughs") until it fills the memory. Each is refused with one line that names the file,
before a byte of it is read or expanded. The kind of file is checked on the open descriptor
(``fstat``); the open itself uses ``O_NONBLOCK``, so that opening a FIFO does not block either. A
symbolic link is followed (a config file may well be one) and what it leads to is checked. A log that grows
with its run (``metrics.jsonl``) is read line by line (:func:`read_lines`), each line capped too.

The checkpoint layer reads its files through these functions as well; standard library and PyYAML only.
"""

from __future__ import annotations

import os
import stat
import typing
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from ..errors import TorchrigError

MiB = 1 << 20
YAML_LIMIT = 1 * MiB  # a config file, as given or beside a checkpoint (torchrig's own are a few KiB)
JSON_LIMIT = 16 * MiB  # meta.json, checkpoints/index.json, skipped_samples.jsonl
RECORD_LIMIT = 1 * MiB  # a small record a run keeps beside its logs (trackers.json: a few ids)
LINES_LIMIT = 1 << 30  # a log that grows with the run, read line by line (metrics.jsonl, csv/metrics.csv)
LINE_LIMIT = 1 * MiB  # one line of such a log (a row of metrics)
ALIAS_LIMIT = 10_000  # values that aliases (*name) may repeat, in all, in one YAML document

ErrorType = Callable[[str], Exception]


def file_kind(mode: int) -> str:
    """``a FIFO``, ``a character device``, ...: what a non-regular file is, for messages."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def size_text(n: int) -> str:
    """``1.5 GiB``, ``16 MiB``, ``812 bytes``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def open_regular(path: str | Path, what: str, todo: str, error: ErrorType) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file; else ``error`` with one line:
    ``{what} '{path}' is a FIFO, not a regular file; {todo}``. An OSError of the open itself (no such
    file, no permission) is raised as it is."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{what} '{path}' is {file_kind(mode)}, not a regular file; {todo}")
        return os.fdopen(fd, "rb")  # O_NONBLOCK means nothing to a regular file
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, limit: int, what: str, todo: str, error: ErrorType) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; else ``error`` with one line."""
    with open_regular(path, what, todo, error) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:  # (or it grew while read)
        raise error(f"{what} '{path}' is {size_text(max(size, len(data)))}, more than the {size_text(limit)} "
                    f"such a file may hold; {todo}")
    return data


def read_lines(path: str | Path, limit: int, what: str, todo: str, error: ErrorType,
               line_limit: int = LINE_LIMIT) -> Iterator[tuple[int, str]]:
    """``(number, text)`` of each line of the regular file ``path`` (from 1; without its newline, undecodable
    bytes replaced), read as it goes: at most ``limit`` bytes in all and ``line_limit`` in one line, else
    ``error`` with one line naming the file (and the line). A last line without its newline (a write cut short)
    is yielded as it is."""
    with open_regular(path, what, todo, error) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise error(f"{what} '{path}' is {size_text(size)}, more than the {size_text(limit)} such a file may "
                        f"hold; {todo}")
        total, number = 0, 0
        while True:
            line = fh.readline(line_limit + 2)  # room for the line and its newline, then one byte more
            if not line:
                return
            number, total = number + 1, total + len(line)
            text = line[:-1] if line.endswith(b"\n") else line
            if len(text) > line_limit:
                raise error(f"{what} '{path}' has a line {number} longer than the {size_text(line_limit)} a line "
                            f"may hold; {todo}")
            if total > limit:  # it grew while read
                raise error(f"{what} '{path}' grew past the {size_text(limit)} such a file may hold; {todo}")
            yield number, text.decode(errors="replace")


# ----------------------------------------------------------------------------- YAML

_LOADERS: dict[bool, type] = {}


def yaml_loader(yaml12_floats: bool = True) -> type:
    """PyYAML's SafeLoader whose aliases may repeat at most ``ALIAS_LIMIT`` values in all, and which
    refuses an alias inside its own anchor. With ``yaml12_floats``, YAML 1.2 floats too: ``1e-4`` is
    a number, not the string '1e-4' (what a user writes; the checkpoint's own config.yaml, written by
    ``yaml.safe_dump``, is read back without it, exactly as written)."""
    if yaml12_floats not in _LOADERS:
        import re

        import yaml

        class Loader(yaml.SafeLoader):
            def compose_document(self) -> Any:
                node = super().compose_document()
                _check_aliases(node, self.name)  # before anything is built from the nodes
                return node

            def construct_mapping(self, node: Any, deep: bool = False) -> dict:
                seen: dict = {}
                for key_node, _ in node.value:  # PyYAML keeps the last of repeated keys without a word
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    if isinstance(key, typing.Hashable):
                        if key in seen:
                            raise _Duplicate(f"{self.name} sets the key {key!r} twice (lines {seen[key]} and "
                                             f"{key_node.start_mark.line + 1}); YAML would keep the last silently: "
                                             f"keep one of them")
                        seen[key] = key_node.start_mark.line + 1
                return super().construct_mapping(node, deep)

        if yaml12_floats:
            Loader.add_implicit_resolver(
                "tag:yaml.org,2002:float",
                re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
        _LOADERS[yaml12_floats] = Loader
    return _LOADERS[yaml12_floats]


def parse_yaml(text: str, source: str, what: str, error: ErrorType, yaml12_floats: bool = True) -> Any:
    """``text`` as YAML through :func:`yaml_loader`. Bad YAML raises PyYAML's own ``YAMLError``; aliases
    beyond the bound, or nesting too deep to read, raise ``error`` with one line naming ``{what} '{source}'``."""
    loader = yaml_loader(yaml12_floats)(text)
    loader.name = f"{what} '{source}'"
    try:
        return loader.get_single_data()
    except (_Expansion, _Duplicate) as exc:
        raise error(str(exc)) from None
    except RecursionError:
        raise error(f"{what} '{source}' nests lists or mappings deeper than can be read (Python's recursion "
                    f"limit); a config is a few levels of keys: check the file") from None
    finally:
        loader.dispose()


class _Expansion(TorchrigError, ValueError):
    """Raised inside PyYAML's composer; ``parse_yaml`` turns it into the caller's error."""


class _Duplicate(TorchrigError, ValueError):
    """A key written twice in one mapping, raised while constructing; ``parse_yaml`` turns it into the caller's
    error."""


def _check_aliases(root: Any, name: str) -> None:
    """Count the values the document would hold with every alias written out (a node once per time it is
    reached); refuse it when aliases would repeat more than ``ALIAS_LIMIT`` of them, or one contains itself."""
    if root is None:
        return
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise _Expansion(f"{name} holds an alias inside its own anchor (a value that contains itself); "
                             f"write the value out instead")
        open_.add(key)
        n = 1
        if isinstance(node.value, list):  # a sequence's nodes, or a mapping's (key node, value node) pairs
            for item in node.value:
                n += size(item[0]) + size(item[1]) if isinstance(item, tuple) else size(item)
        open_.discard(key)
        sizes[key] = n
        return n

    repeated = size(root) - len(sizes)
    if repeated > ALIAS_LIMIT:
        raise _Expansion(f"{name} repeats {repeated} values through aliases (*name), more than the {ALIAS_LIMIT} "
                         f"torchrig reads (a \"billion laughs\" would fill the memory); write the values out, or "
                         f"repeat fewer of them")
