"""Regular files only, read within a bound: how colibri opens the files of a directory it
does not control (a checkpoint's ``config.json``, index, shards, tokenizer files).

A name in such a directory can be anything: a FIFO (opening it blocks until a writer comes),
a device (endless bytes), a directory, a dangling symlink. :func:`check_regular` follows
symlinks as ``open`` does (a Hugging Face cache snapshot is symlinks into ``blobs/``) and
refuses anything but a regular file by its type, before anything is opened;
:func:`open_regular` opens without blocking and checks the type again on the open file (the
name may have changed in between); :func:`read_regular` reads a whole file of at most
``limit`` bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from colibri._errors import FormatError

__all__ = ["CheckpointError", "MissingFileError", "check_regular", "open_regular", "read_regular"]

_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO opens at once instead of waiting for a writer
_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


class CheckpointError(FormatError):
    """A checkpoint directory that is incomplete, inconsistent or not servable (a
    :class:`colibri.FormatError`, so a ``ValueError`` too)."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file a checkpoint needs is not there (also a ``FileNotFoundError``)."""


def _refuse(path: Path, what: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(
            f"{path}: {what} is {kind}; colibri reads only regular files (or symlinks to them) "
            "here: replace it with the file itself"
        )


def check_regular(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it is a regular file or a symlink to one.

    Parameters
    ----------
    path : path-like
        The file.
    what : str
        What the file is (``"config.json"``, ``"a shard"``), for the message.

    Raises
    ------
    MissingFileError
        Nothing is there (or a dangling symlink); also a ``FileNotFoundError``.
    CheckpointError
        It is a directory, a FIFO, a device or a socket; nothing was opened.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise MissingFileError(f"{path}: {what} is missing") from None
    except NotADirectoryError:
        raise MissingFileError(f"{path}: {what} is missing (a parent is not a folder)") from None
    _refuse(path, what, mode)
    return path


def open_regular(path: str | os.PathLike, what: str) -> BinaryIO:
    """Open ``path`` for binary reading, never blocking, if it is a regular file.

    Raises
    ------
    MissingFileError, CheckpointError
        As :func:`check_regular`, checked on the open file.
    """
    path = check_regular(path, what)
    try:
        fd = os.open(path, _FLAGS | _NONBLOCK)
    except FileNotFoundError:
        raise MissingFileError(f"{path}: {what} is missing") from None
    try:
        _refuse(path, what, os.fstat(fd).st_mode)  # replaced since check_regular looked
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused unread when over ``limit`` bytes.

    Raises
    ------
    MissingFileError, CheckpointError
        As :func:`open_regular`; also a file larger than ``limit`` (checked before reading,
        and again on what the read returns: the file may grow meanwhile).
    """
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise CheckpointError(
            f"{path}: {what} is {max(size, len(data))} bytes, more than the {limit} allowed; "
            "it is not the file it should be"
        )
    return data
