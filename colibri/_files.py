"""How colibri touches expert bytes: positional reads into caller buffers, or file mappings.

:class:`FileReader` (the Pager's ``io="read"``): POSIX (Linux, macOS, BSD) opens one descriptor
per file, shared by all threads, read with ``os.preadv`` (or ``os.pread`` + copy where
``preadv`` is missing); positional reads carry their own offset, so threads never race on a
file position. Windows has no ``os.pread``: each thread opens its own unbuffered handle per
file and uses ``seek`` + ``readinto``. A short read is retried; end of file raises
:class:`FileChangedError`; a disk error raises ``OSError`` naming the file and the range.

:class:`FileMap` (``io="mmap"`` and ``io="view"``): a read-only shared mapping of a range of
one file, handed out as a numpy ``uint8`` array. The mapping is ``MADV_RANDOM``: a page fault
reads its own page, never the device's readahead window around it (several MiB on many
devices: a cold expert would cost more than its own bytes). ``populate`` makes a range
resident: ``MADV_WILLNEED`` reads exactly that range, then ``MADV_POPULATE_READ`` (Linux >=
5.14, which reports an I/O error or a truncated file as ``OSError`` instead of a ``SIGBUS``
on first access; elsewhere a read of one byte per OS page) maps it, ``drop`` takes pages out
of the process (``MADV_DONTNEED``: page-table entries go, the page cache keeps its copy, the
next access re-faults from the file; with ``pageout``, ``MADV_PAGEOUT`` first drops that copy
too). ``close`` unmaps, unless views are still alive: then
the mapping lives until the last view dies (never a ``BufferError``, never memory pulled
from under a view).

Fault injection: every syscall that moves file bytes goes through :meth:`FileReader._pread`
or :meth:`FileMap._advise`; tests replace these to inject ``EIO`` and short reads.

Files that change: :func:`identity` records what a file was when opened, :func:`check_same`
raises :class:`FileChangedError` naming the file when it has since been replaced, deleted,
resized or modified. A mapping of a file truncated *after* the check would raise ``SIGBUS``
on access; the pager registers its mappings with colibri's SIGBUS guard (POSIX,
``colibri/_guard.pyx``), which reads such pages as zeros and turns the batch's release into a
:class:`FileChangedError`. Reads never fault (a short read is an error, not a signal): use
``io="read"`` for files that may change while in use (or network file systems).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading

import numpy as np

from colibri._errors import ColibriError

__all__ = ["FileChangedError", "FileMap", "FileReader", "check_same", "identity"]

_HAS_PREAD = hasattr(os, "pread")
_HAS_PREADV = hasattr(os, "preadv")
#: ``os.open`` flags for a weight file: read-only, binary on Windows, not inherited by children.
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
#: What direct reads (``O_DIRECT``: around the page cache) align their buffer's address, file
#: offset and length to; Linux asks at most the device's logical block, 4096 covers them all.
DIRECT_ALIGN = 4096
#: Direct reads exist (Linux).
HAS_DIRECT = hasattr(os, "O_DIRECT") and _HAS_PREADV

#: ``madvise`` exists (not on Windows).
HAS_MADVISE = hasattr(mmap.mmap, "madvise")
#: ``MADV_PAGEOUT`` (Linux >= 5.4): reclaim the range's pages now; Python < 3.13 lacks it.
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform.startswith("linux") else None)
#: ``MADV_POPULATE_READ`` (Linux >= 5.14); Python < 3.13 lacks the constant, its value is 22.
MADV_POPULATE_READ = getattr(
    mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None
)


def _libc_madvise():
    """libc's ``madvise`` through ctypes, which releases the GIL during the call (Python's
    ``mmap.madvise`` holds it, stalling every thread while a cold range is read)."""
    if not HAS_MADVISE:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


class FileChangedError(ColibriError, OSError):
    """A weight file was truncated, replaced, deleted or modified while a Pager used it."""


def identity(fd: int) -> tuple[int, int, int, int]:
    """What an open file is now: ``(st_dev, st_ino, st_size, st_mtime_ns)``."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_same(path: str, recorded: tuple[int, int, int, int], where: str = "load()") -> None:
    """Raise :class:`FileChangedError` unless ``path`` is still the file ``recorded`` saw."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        what = "it was deleted"
    else:
        dev, ino, size, mtime = recorded
        if (st.st_dev, st.st_ino) != (dev, ino):
            what = "it was replaced by another file"
        elif st.st_size != size:
            what = f"its size changed from {size} to {st.st_size} bytes"
        elif st.st_mtime_ns != mtime:
            what = "it was modified"
        else:
            return
    raise FileChangedError(
        f"{where}: weight file {path!r} must not change while a Pager uses it ({what}); "
        "open a new Pager on the file as it is now (io='read' tolerates files that may change "
        "without risking SIGBUS)"
    )


class FileReader:
    """Positional reads from a fixed set of files; thread-safe; ``close()`` is idempotent.

    ``close()`` waits for reads in progress, so a descriptor is never closed (and its number
    reused) under a reader. With ``direct`` (Linux), :meth:`readinto` can read around the
    page cache (``O_DIRECT``): a file whose file system refuses it is read as usual.
    """

    def __init__(self, paths, *, direct: bool = False) -> None:
        self._paths = tuple(paths)
        self._lock = threading.Condition()
        self._active = 0
        self._closed = False
        self._fds: dict[str, int] = {}
        self._direct: dict[str, int] = {}  # O_DIRECT descriptors, by path
        self._refused: set[str] = set()  # paths whose file system refused a direct read
        self._local = threading.local()
        self._handles: list = []  # every per-thread Windows handle, to close them all
        if _HAS_PREAD:
            try:
                for p in self._paths:
                    self._fds[p] = os.open(p, OPEN_FLAGS)
                    if direct and HAS_DIRECT:
                        with contextlib.suppress(OSError):  # EINVAL: tmpfs, some FUSE
                            self._direct[p] = os.open(p, OPEN_FLAGS | os.O_DIRECT)
            except BaseException:
                self.close()
                raise

    def direct(self, path: str) -> bool:
        """Whether :meth:`readinto` reads ``path`` around the page cache when asked."""
        return path in self._direct and path not in self._refused

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self, path: str) -> int:
        """The descriptor reads of ``path`` go through (this thread's, on Windows)."""
        return self._fds[path] if _HAS_PREAD else self._handle(path).fileno()

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

    def _pread(self, path: str, view: memoryview, offset: int, direct: bool = False) -> int:
        """Read up to ``len(view)`` bytes at ``offset`` into ``view``; the count read (0 at end
        of file), through the ``O_DIRECT`` descriptor if ``direct``. The one place bytes come
        from the file (tests inject faults here)."""
        if direct:
            return os.preadv(self._direct[path], [view], offset)
        if _HAS_PREADV:
            return os.preadv(self._fds[path], [view], offset)
        if _HAS_PREAD:
            data = os.pread(self._fds[path], min(len(view), 1 << 30), offset)
            view[: len(data)] = data
            return len(data)
        f = self._handle(path)
        f.seek(offset)
        return f.readinto(view) or 0

    @contextlib.contextmanager
    def _open(self):
        """Counted as in progress (``close()`` waits for it); ValueError once closed."""
        with self._lock:
            if self._closed:
                raise ValueError("read from a closed weight file reader")
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def readinto(
        self, path: str, offset: int, buffer: memoryview, *, need: int | None = None,
        direct: bool = False,
    ) -> None:  # fmt: skip
        """Fill ``buffer`` with the bytes of ``path`` at ``offset``.

        ``need``: how many of them must be read (default all); the rest may lie past the
        end of the file. ``direct``: around the page cache where the file allows it; the
        buffer's address, ``offset`` and ``len(buffer)`` are then multiples of
        :data:`DIRECT_ALIGN` (the caller's promise). A file system that refuses a direct read
        (``EINVAL``) has the file read as usual from then on.

        Raises
        ------
        FileChangedError
            The file ends before the range (it was truncated after it was opened).
        OSError
            The read failed (``EIO`` from the disk, ...): the message names file and range.
        """
        with self._open():
            done, total = 0, len(buffer)
            need = total if need is None else need
            direct = direct and path in self._direct and path not in self._refused
            while done < need:
                aligned = direct and done % DIRECT_ALIGN == 0
                try:
                    n = self._pread(path, buffer[done:], offset + done, aligned)
                except OSError as exc:
                    if exc.errno == errno.EINTR:
                        continue
                    if aligned and exc.errno == errno.EINVAL:  # refused: read it as usual
                        direct = False
                        self._refused.add(path)  # its descriptor closes with the reader
                        continue
                    raise OSError(
                        exc.errno,
                        f"{path}: reading {total} bytes at {offset} failed at byte "
                        f"{offset + done} ({exc.strerror or exc})",
                    ) from exc
                if not n:
                    raise FileChangedError(
                        f"{path}: unexpected end of file at byte {offset + done} while reading "
                        f"{total} bytes at {offset}; the file was truncated after it was opened"
                    )
                done += n

    def advise(self, path: str, offset: int, length: int) -> bool:
        """Ask the OS to start reading ``length`` bytes of ``path`` at ``offset`` into its page
        cache (``posix_fadvise(WILLNEED)``, asynchronous); False where it cannot or once
        closed. Errors are the OS's to report at the read, not here."""
        if not (_HAS_PREAD and hasattr(os, "posix_fadvise")):
            return False
        try:
            with self._open():
                os.posix_fadvise(self._fds[path], offset, length, os.POSIX_FADV_WILLNEED)
            return True
        except (OSError, ValueError):  # ValueError: closed
            return False

    def close(self) -> None:
        """Wait for reads in progress, then close every descriptor and handle."""
        with self._lock:
            self._closed = True
            while self._active:
                self._lock.wait()
            fds, self._fds = [*self._fds.values(), *self._direct.values()], {}
            self._direct = {}
            handles, self._handles = self._handles, []
        for fd in fds:
            os.close(fd)
        for f in handles:
            f.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FileMap:
    """A read-only shared mapping of bytes ``[offset, offset + length)`` of a file.

    ``offset`` must be a multiple of ``mmap.ALLOCATIONGRANULARITY`` (64 KiB on Windows, the OS
    page elsewhere). ``array`` is the mapping as a ``uint8 [length]`` numpy array; views of it
    keep the mapping alive. Offsets given to the methods are relative to the mapping.
    Thread-safe: ``close()`` waits for calls in progress.
    """

    _populate_works = MADV_POPULATE_READ is not None  # cleared at the first EINVAL
    _pageout_works = MADV_PAGEOUT is not None  # cleared at the first EINVAL

    def __init__(self, path: str, fd: int, offset: int, length: int) -> None:
        self.path, self.offset, self.length = path, offset, length
        self._mmap: mmap.mmap | None = mmap.mmap(fd, length, access=mmap.ACCESS_READ,
                                                 offset=offset)  # fmt: skip
        self.array: np.ndarray | None = np.frombuffer(self._mmap, np.uint8)
        self.address = self.array.ctypes.data
        self._lock = threading.Condition()
        self._active = 0
        if HAS_MADVISE:  # a fault reads its own page, not the device's readahead window
            self._advise(mmap.MADV_RANDOM, 0, length)

    def _advise(self, option: int, start: int, length: int) -> None:
        """``madvise`` of a page-aligned range (tests inject faults here)."""
        if _MADVISE is None:
            self._mmap.madvise(option, start, length)
        elif _MADVISE(self.address + start, length, option):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def _call(self, option: int, start: int, length: int) -> bool:
        """:meth:`_advise` unless closed (then False); the mapping cannot go meanwhile."""
        with self._lock:
            if self._mmap is None:
                return False
            self._active += 1
        try:
            self._advise(option, start, length)
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()
        return True

    def populate(self, start: int, length: int) -> None:
        """Make bytes ``[start, start + length)`` resident (``start`` page-aligned).

        Raises ``OSError`` naming the file and the range when the pages cannot be read, and
        ``ValueError`` when the mapping was closed.
        """
        length = min(length, self.length - start)
        if length <= 0:
            return
        try:
            # MADV_RANDOM (set at mapping) keeps faults from reading around the range;
            # WILLNEED reads exactly the range, in large requests, before the pages are mapped
            if HAS_MADVISE and not self._call(mmap.MADV_WILLNEED, start, length):
                raise ValueError(f"{self.path}: the mapping was closed")
            if HAS_MADVISE and FileMap._populate_works:
                try:
                    if self._call(MADV_POPULATE_READ, start, length):
                        return
                    raise ValueError(f"{self.path}: the mapping was closed")
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: the kernel predates 5.14
                        raise
                    FileMap._populate_works = False
            array = self.array
            if array is None:
                raise ValueError(f"{self.path}: the mapping was closed")
            int(array[start : start + length : mmap.PAGESIZE].max())  # one read a page
        except OSError as exc:
            first = self.offset + start
            raise OSError(
                exc.errno,
                f"{self.path}: making bytes [{first}, {first + length}) resident failed "
                f"({exc.strerror or exc}): the disk returned an error or the file shrank",
            ) from exc

    def advise(self, start: int, length: int) -> bool:
        """Ask the OS to start reading bytes ``[start, start + length)`` (``start``
        page-aligned) into its page cache (``MADV_WILLNEED``, asynchronous), mapping none of
        them; False where the OS cannot, once closed or on an error (the access reports it)."""
        length = min(length, self.length - start)
        if length <= 0 or not HAS_MADVISE:
            return False
        try:
            return self._call(mmap.MADV_WILLNEED, start, length)
        except OSError:
            return False

    def drop(self, start: int, length: int, *, pageout: bool = False) -> bool:
        """Take bytes ``[start, start + length)`` out of the process (``MADV_DONTNEED``);
        False where the OS cannot (Windows: close the mapping instead) or once closed.

        With ``pageout``, first ``MADV_PAGEOUT``: the page cache's copy goes too, unless
        another process maps it (or the file is not this user's to page out: then it stays,
        as it does on kernels before 5.4).
        """
        length = min(length, self.length - start)
        if length <= 0:
            return True
        if pageout and HAS_MADVISE and FileMap._pageout_works:
            try:
                self._call(MADV_PAGEOUT, start, length)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: the kernel predates 5.4
                    raise
                FileMap._pageout_works = False
        return HAS_MADVISE and self._call(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        """Unmap now, or when the last view dies if views are alive; idempotent."""
        with self._lock:
            while self._active:
                self._lock.wait()
            m, self._mmap = self._mmap, None
            self.array = None
        if m is not None:
            with contextlib.suppress(BufferError):  # views alive: they keep it mapped
                m.close()
