"""Reading the files a run is pointed at, and writing the files of a run, study or checkpoint folder.

Reading: regular files only, small kinds of file with a size cap, and YAML whose aliases cannot blow it up.
A path can name a FIFO (a read blocks for ever), a device (``/dev/zero`` never ends), a directory, or
a file far bigger than its kind ever is; a tiny YAML file can repeat one list through nested aliases
("billion laughs") until it fills the memory. Each is refused with one line that names the file,
before a byte of it is read or expanded. The kind of file is checked on the open descriptor
(``fstat``); the open itself uses ``O_NONBLOCK``, so that opening a FIFO does not block either. A
symbolic link is followed (a config file may well be one) and what it leads to is checked. A log that grows
with its run (``metrics.jsonl``) is read line by line (:func:`read_lines`), each line capped too.

Writing: a folder torchrig writes into may come from someone else (a run copied from a colleague, a
study unpacked from an archive), and a symbolic link planted in it must never carry a write outside it.
So every file torchrig writes goes through the few functions of this module, which never follow a
link where the file itself goes and never write into a folder that is a link:

- ``write_atomic`` / ``atomic_file``: the bytes go to a new temporary file with a random name in the
  target's own folder, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (nothing that stands there can
  be opened instead), flushed with ``fsync`` and renamed over the target with ``os.replace`` (which
  replaces a link standing there, never what it points to). A reader sees the old file or the new one.
- ``open_append``: an append (``metrics.jsonl``) opens with ``O_NOFOLLOW | O_NONBLOCK`` and refuses
  anything but a regular file: a link, a FIFO, a device.
- ``replace_link``: a symbolic link (``latest``, ``best``) made under a random name, then renamed over.
- ``make_dir`` / ``make_temp_dir`` / ``staged``: folders, checked not to be links; a library that
  writes to a path of its own choosing writes into a fresh temporary folder that is renamed into place.

The folder is opened once (``O_DIRECTORY | O_NOFOLLOW``) and the file is made relative to that
descriptor (``openat``), so the folder cannot be swapped for a link between the check and the write.
``root`` names the folder the caller was given (a run folder, a study folder, which the user may well
have made a link); every folder below it, down to the file's own, must be a real folder. Without
``root`` the file's own folder must be one.

The checkpoint layer reads and writes its files through these functions as well; standard library and
PyYAML only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import typing
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional, TextIO

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


# ----------------------------------------------------------------------------- writing


class UnsafePathError(TorchrigError, OSError):
    """A write refused before a byte of it was written: it would go through a symbolic link, or into something
    that is not a folder (or not a regular file). An OSError too, so that a write allowed to fail without
    failing the run (a plot) says why in its one line, as it does for a full disk."""


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NAME_ROOM = 200  # of a target's name kept in its temporary name (a name may have 255 bytes)


def what_is(path: str | Path, dir_fd: Optional[int] = None) -> str:
    """What stands at ``path`` (not following a link): ``a symbolic link (to 'x')``, ``a regular file``,
    ``a FIFO`` ..., or ``missing``."""
    try:
        mode = os.lstat(path, dir_fd=dir_fd).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to '{os.readlink(path, dir_fd=dir_fd)}')"
        except OSError:
            return "a symbolic link"
    return "a regular file" if stat.S_ISREG(mode) else file_kind(mode)


def _not_a_folder(path: Path, kind: str) -> UnsafePathError:
    return UnsafePathError(f"'{path}' is {kind}, not a folder; torchrig writes into a run or study folder only "
                           f"through folders of its own, never through a link: remove it, or choose another folder")


def open_dir(folder: str | Path, root: str | Path | None = None, create: bool = False) -> int:
    """A descriptor of ``folder``, to make files in relative to it; ``folder``, and with ``root`` every folder
    from below ``root`` down to it, must be a real folder (else ``UnsafePathError``). ``root`` itself is
    followed when it is a link (the user named it). ``create``: missing folders are made."""
    folder = Path(folder)
    if root is not None:
        base, parts = Path(root), list(folder.relative_to(root).parts)
    elif folder.name in ("", ".", ".."):
        base, parts = folder, []
    else:
        base, parts = folder.parent, [folder.name]
    if ".." in parts:
        raise ValueError(f"'{folder}': a folder to write into is named without '..'")
    if create:
        base.mkdir(parents=True, exist_ok=True)
    fd, here = os.open(base, _DIR), base
    try:
        for part in parts:
            here = here / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                inner = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                kind = what_is(part, fd)
                if kind == "missing" or exc.errno == errno.EACCES:
                    raise
                raise _not_a_folder(here, kind) from None
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(folder: str | Path, root: str | Path | None = None) -> Path:
    """``folder``, made with its missing parents; refused when it (or, with ``root``, a folder between ``root``
    and it) is a link or not a folder."""
    os.close(open_dir(folder, root, create=True))
    return Path(folder)


def _fresh(stem: str, make: Callable[[str], Any]) -> str:
    """A new name, ``stem`` and 12 random hex digits, made by ``make(name)``, which fails on a name in use."""
    for _ in range(100):
        name = f"{stem}{secrets.token_hex(6)}"
        try:
            make(name)
            return name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name '{stem}*' after 100 tries")


@contextlib.contextmanager
def atomic_file(path: str | Path, root: str | Path | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new bytes into: a new temporary file ``.NAME.tmp-RANDOM`` in
    ``path``'s own folder (``O_CREAT | O_EXCL | O_NOFOLLOW``); leaving the block without an error flushes it,
    ``fsync``s it and renames it over ``path`` (a link there is replaced, never followed); an error removes
    it. The file's ``name`` is its temporary path."""
    path = Path(path)
    dfd = open_dir(path.parent, root)
    try:
        made: list[int] = []
        name = _fresh(f".{path.name[:_NAME_ROOM]}.tmp-", lambda n: made.append(os.open(n, _NEW, 0o666, dir_fd=dfd)))
        try:
            with open(str(path.with_name(name)), "wb", opener=lambda *_: made[0]) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(name, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)  # a full disk must not keep the half file
            raise
    finally:
        os.close(dfd)


def write_atomic(path: str | Path, data: bytes, root: str | Path | None = None) -> None:
    """``path`` holds ``data``, whole or not at all, written through ``atomic_file``."""
    with atomic_file(path, root) as fh:
        fh.write(data)


def open_append(path: str | Path, what: str, todo: str, error: ErrorType = UnsafePathError,
                root: str | Path | None = None) -> TextIO:
    """``path`` opened to append text lines (made when missing; line-buffered). A link (never followed:
    ``O_NOFOLLOW``; a hard link, one file of several names, refused too), a FIFO (``O_NONBLOCK``: the open does not wait for a reader), a device or a folder in its
    place is refused with ``error``: ``{what} '{path}' is a FIFO, not a regular file; {todo}``."""
    path = Path(path)
    dfd = open_dir(path.parent, root)
    try:
        fd = os.open(path.name, _APPEND, 0o666, dir_fd=dfd)
    except OSError:
        kind = what_is(path.name, dfd)
        if kind in ("missing", "a regular file"):
            raise
        raise error(f"{what} '{path}' is {kind}, not a regular file; {todo}") from None
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise error(f"{what} '{path}' is {file_kind(st.st_mode)}, not a regular file; {todo}")
    if st.st_nlink > 1:  # another name of the same file (a hard link): appending would write there too
        os.close(fd)
        raise error(f"{what} '{path}' is a hard link ({st.st_nlink} names of one file), not a file of this run's "
                    f"own; {todo}")
    return open(fd, "a", buffering=1, encoding="utf-8", newline="")


def refuse_link(path: str | Path, what: str, todo: str, error: ErrorType = UnsafePathError) -> None:
    """``error`` when ``path`` is a symbolic link: a file torchrig rewrites in place of its own (a resumed
    run's ``metrics.jsonl``) is never one."""
    kind = what_is(path)
    if kind.startswith("a symbolic link"):
        raise error(f"{what} '{path}' is {kind}, not a regular file; {todo}")


def open_own(path: str | Path, create: bool, refuse: Callable[[str], Exception]) -> int:
    """A read-write descriptor of ``path`` for a file rewritten in place (a lock file), which must be a regular
    file with no other name: a symbolic link is never followed (``O_NOFOLLOW``), and a hard link, a FIFO, a
    device or a directory is refused with ``refuse(what it is)`` before a byte of it is touched. ``O_CREAT``
    (``create``) without ``O_EXCL`` / ``O_TRUNC`` opens an existing file as it is; ``O_NONBLOCK`` keeps a FIFO
    from blocking the open. The open's own OSError (no permission ...) is raised as it is."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        kind = what_is(path)
        if kind in ("missing", "a regular file"):  # nothing there, or no access: the open's own error says more
            raise
        raise refuse(kind) from None
    st = os.fstat(fd)
    what = None if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
    if what is None and st.st_nlink != 1:
        what = f"a file with {st.st_nlink} hard links (another name of it lies elsewhere)"
    if what is not None:
        os.close(fd)
        raise refuse(what)
    return fd


def replace_link(target: str, link: str | Path, root: str | Path | None = None,
                 before: Optional[Callable[[Path], None]] = None) -> None:
    """Point the symbolic link ``link`` at ``target``, atomically: a new link ``.NAME.tmp-RANDOM`` beside it,
    renamed over it. ``before(temporary path)`` runs just before the rename."""
    link = Path(link)
    dfd = open_dir(link.parent, root)
    try:
        name = _fresh(f".{link.name[:_NAME_ROOM]}.tmp-", lambda n: os.symlink(target, n, dir_fd=dfd))
        try:
            if before is not None:
                before(link.with_name(name))
            os.replace(name, link.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def make_temp_dir(parent: str | Path, stem: str, root: str | Path | None = None) -> Path:
    """A new empty folder ``parent/STEM RANDOM`` (``parent`` checked as ``open_dir`` does)."""
    dfd = open_dir(parent, root)
    try:
        return Path(parent) / _fresh(stem, lambda n: os.mkdir(n, dir_fd=dfd))
    finally:
        os.close(dfd)


@contextlib.contextmanager
def staged(path: str | Path, root: str | Path | None = None) -> Iterator[Path]:
    """Where a library that writes to a path of its own (``torch.export.save``, ``save_pretrained``, the
    profiler's trace) writes ``path``: the same name in a new temporary folder beside it. Leaving the block
    without an error renames what was written there into place (a link at ``path`` is replaced, never
    followed; a folder at ``path`` is replaced whole); the temporary folder is then removed either way."""
    path = Path(path)
    folder = make_temp_dir(path.parent, f".{path.name[:_NAME_ROOM]}.tmp-", root)
    try:
        yield folder / path.name
        _publish(folder, path, root)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _publish(folder: Path, path: Path, root: str | Path | None) -> None:
    new = folder / path.name
    for f in ([new] if not new.is_dir() else sorted(new.rglob("*"))):
        if f.is_file() and not f.is_symlink():
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    dfd = open_dir(path.parent, root)
    try:
        if new.is_dir():  # a folder is not renamed over anything but an empty folder: clear the way
            kind = what_is(path.name, dfd)
            if kind == "a directory":
                os.rename(path.name, f"{folder.name}/.old", src_dir_fd=dfd, dst_dir_fd=dfd)
            elif kind != "missing":
                os.unlink(path.name, dir_fd=dfd)
        os.replace(f"{folder.name}/{path.name}", path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)
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
