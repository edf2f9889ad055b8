"""Explicit positional reads into caller buffers: the only way colibri touches expert bytes.

POSIX (Linux, macOS, BSD): one descriptor per file, shared by all threads, read with
``os.preadv`` (or ``os.pread`` + copy where ``preadv`` is missing); positional reads carry their
own offset, so threads never race on a file position.

Windows has no ``os.pread``: each thread opens its own unbuffered handle per file and uses
``seek`` + ``readinto``. colibri never maps weight files there, because Windows has no
``madvise`` (a mapping can only be trimmed by closing it), maps at 64 KiB granularity, and
serialises concurrent reads of a file while any mapping of it is alive.
"""

from __future__ import annotations

import os
import threading

__all__ = ["FileReader"]

_HAS_PREAD = hasattr(os, "pread")
_HAS_PREADV = hasattr(os, "preadv")


class FileReader:
    """Positional reads from a fixed set of files; thread-safe; ``close()`` is idempotent.

    ``close()`` waits for reads in progress, so a descriptor is never closed (and its number
    reused) under a reader.
    """

    def __init__(self, paths) -> None:
        self._paths = tuple(paths)
        self._lock = threading.Condition()
        self._active = 0
        self._closed = False
        self._fds: dict[str, int] = {}
        self._local = threading.local()
        self._handles: list = []  # every per-thread Windows handle, to close them all
        if _HAS_PREAD:
            flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
            try:
                for p in self._paths:
                    self._fds[p] = os.open(p, flags)
            except BaseException:
                self.close()
                raise

    @property
    def closed(self) -> bool:
        return self._closed

    def _handle(self, path: str):
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        f = handles.get(path)
        if f is None:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
            handles[path] = f
            with self._lock:
                self._handles.append(f)
        return f

    def readinto(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes of ``path`` at ``offset``; raise on a short file."""
        with self._lock:
            if self._closed:
                raise ValueError("read from a closed weight file reader")
            self._active += 1
        try:
            done, total = 0, len(buffer)
            while done < total:
                view = buffer[done:]
                if _HAS_PREADV:
                    n = os.preadv(self._fds[path], [view], offset + done)
                elif _HAS_PREAD:
                    data = os.pread(self._fds[path], min(len(view), 1 << 30), offset + done)
                    n = len(data)
                    view[:n] = data
                else:
                    f = self._handle(path)
                    f.seek(offset + done)
                    n = f.readinto(view)
                if not n:
                    raise OSError(
                        f"{path}: unexpected end of file at byte {offset + done} while reading "
                        f"{total} bytes at {offset}; the file was truncated after it was opened"
                    )
                done += n
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def close(self) -> None:
        """Wait for reads in progress, then close every descriptor and handle."""
        with self._lock:
            self._closed = True
            while self._active:
                self._lock.wait()
            fds, self._fds = self._fds, {}
            handles, self._handles = self._handles, []
        for fd in fds.values():
            os.close(fd)
        for f in handles:
            f.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
