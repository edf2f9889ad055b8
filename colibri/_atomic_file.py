"""Write a file atomically: a temporary file in the same folder, then renamed into place.

An interrupted write leaves either the old file or nothing at the destination, never a half
file. Without ``overwrite`` an existing destination is refused, also when it appears while the
temporary file is being written (the final step is a hard link, which fails on an existing
name; on file systems without hard links it falls back to a checked rename). The new file is
flushed to disk before it is published, and (``write_atomically``) the folder after.

Temporaries are hidden files named ``.<name>.<host>.<pid>.<random>.tmp``. A process killed
mid-write (``SIGKILL``, power loss) cannot remove its own; the next write of the same file
removes those whose process is gone (same host, POSIX).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
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
        sync_folder(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def refuse_existing(path: str, overwrite: bool) -> None:
    """Raise FileExistsError when ``path`` exists and ``overwrite`` is false."""
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")


def temporary_beside(path: str) -> tuple[int, str]:
    """A new temporary file in ``path``'s folder (same file system): ``(fd, name)``.

    Temporaries of ``path`` left by dead processes of this host are removed first.
    """
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _sweep(folder, base)
    return tempfile.mkstemp(dir=folder, prefix=f".{base}.{_host()}.{os.getpid()}.", suffix=".tmp")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def _sweep(folder: str, base: str) -> bool:
    """Remove ``folder``'s temporaries of ``base`` whose writer (this host) no longer runs.

    Returns True when a temporary of ``base`` is left that may still be written: its writer
    runs, or it comes from another host, or this system cannot tell (not POSIX).
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return True
    ours = re.compile(re.escape(f".{base}.{_host()}.") + r"(\d+)\.[^.]+\.tmp")
    anyone = re.compile(re.escape(f".{base}.") + r"[A-Za-z0-9-]+\.\d+\.[^.]+\.tmp")
    live = False
    for name in names:
        match = ours.fullmatch(name)
        if match is None or os.name != "posix":  # os.kill(pid, 0) would kill on Windows
            live = live or anyone.fullmatch(name) is not None
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:  # its writer is gone: the file can never be published
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
        except (PermissionError, OverflowError):  # alive (another user's) or not a pid
            live = True
        else:
            live = True
    return live


def sweep(path: str) -> bool:
    """Remove the temporaries of ``path`` left by dead writers; True when a writer of ``path``
    may still be running (one of its temporaries is left)."""
    return _sweep(os.path.dirname(os.path.abspath(path)), os.path.basename(path))


def sync_folder(path: str) -> None:
    """Flush the folder entry of a just-published ``path`` (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(temporary: str, path: str, *, overwrite: bool, keep: bool = False) -> None:
    """Move the finished ``temporary`` to ``path`` in one step; without ``overwrite`` an
    existing ``path`` is never replaced, even one that appeared meanwhile. ``keep`` leaves
    ``temporary`` as a second name of the file where hard links allow it (its writer removes it
    later: while it exists, ``sweep`` reports the write under way)."""
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
        if not keep:
            os.unlink(temporary)
