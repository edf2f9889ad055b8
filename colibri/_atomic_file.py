"""Write a file atomically: a temporary file in the same folder, then renamed into place.

An interrupted write leaves either the old file or nothing at the destination, never a half
file. Without ``overwrite`` an existing destination is refused, also when it appears while the
temporary file is being written (the final step is a hard link, which fails on an existing
name; on file systems without hard links it falls back to a checked rename).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def write_atomically(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], None], *, overwrite: bool
) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then move it to ``path``.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false.
    """
    path = os.fspath(path)
    refuse_existing(path, overwrite)
    fd, temporary = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        publish(temporary, path, overwrite=overwrite)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def refuse_existing(path: str, overwrite: bool) -> None:
    """Raise FileExistsError when ``path`` exists and ``overwrite`` is false."""
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")


def temporary_beside(path: str) -> tuple[int, str]:
    """A new temporary file in ``path``'s folder (same file system): ``(fd, name)``."""
    folder = os.path.dirname(os.path.abspath(path))
    return tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")


def publish(temporary: str, path: str, *, overwrite: bool) -> None:
    """Move the finished ``temporary`` to ``path`` in one step; without ``overwrite`` an
    existing ``path`` is never replaced, even one that appeared meanwhile."""
    if overwrite:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it") from None
    except OSError:  # no hard links on this file system
        refuse_existing(path, overwrite)
        os.replace(temporary, path)
    else:
        os.unlink(temporary)
