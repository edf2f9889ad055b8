"""How a slot's expert becomes readable: the pager's I/O backends (``io=``).

``"mmap"`` (default on Linux and macOS)
    Every file is mapped read-only once; views are zero-copy arrays into the mapping (two
    processes serving one file share one copy in the page cache). The pager keeps one counter
    per page (a compact numpy array per file: how many resident experts use the page). Loading
    an expert makes its pages resident (``MADV_POPULATE_READ``; without it ``MADV_WILLNEED``),
    evicting it drops the pages no other resident expert uses (``MADV_DONTNEED``), so a page
    shared by two experts is released with the last of them. Where the memory this process
    may use (its cgroup limit, or what the machine has available) cannot hold the files, an
    evicted expert's pages leave the page cache as well (``MADV_PAGEOUT``): kept, they would
    fill the limit, and each later read would wait for the kernel to reclaim memory (at
    half a 1.6 GB file's size: 112 ms of system time a token, re-faulted library pages
    among it). Where memory holds the files, the page cache keeps them for later misses. The
    kernel may map more than asked (it maps whole large folios of the page cache, up to 2 MiB,
    on a fault); right after a load the pager drops again the pages around it that it does
    not hold.
``"view"`` (default on Windows, where ``madvise`` is missing)
    Each resident expert's page run is mapped as its own view (offset rounded down to
    ``mmap.ALLOCATIONGRANULARITY``, 64 KiB on Windows) and unmapped when it is evicted. A
    page shared by two experts is mapped, and counted, once per expert.
``"read"`` (default where the memory this process may use cannot hold the files)
    Experts are copied with explicit positional reads (``os.preadv``) into one preallocated
    pool of ``capacity`` slots. Never maps a file: use it for files that may change while in
    use and for network file systems (a truncated file is a short read, not a ``SIGBUS``).
    Where memory cannot hold the files, the reads go around the page cache (``O_DIRECT``,
    Linux; each range widened to 4 KiB-aligned ends): they stream at the device's rate and
    leave the limit to the pool, where the page cache would fill it and make every later read
    wait for the kernel to reclaim memory. A file system that refuses direct reads is read
    as usual.

Every backend has the same contract (:class:`_IO`): ``claim``/``release`` account an expert's
pages when it enters or leaves a slot, ``fetch`` does the I/O, ``settle`` follows a
successful fetch, ``owners`` says where each matrix lies for views, ``faulted`` whether a
mapping an expert is read through met the end of its file.

Files that shrink under a mapping: each mapping is registered with colibri's ``SIGBUS`` guard
(:mod:`colibri._guard`, POSIX) for as long as it is mapped. A read of a page the file no
longer holds then reads zeros instead of killing the process, and the guard marks the
mapping; the pager checks the mark when a fetch or an :class:`~colibri.pager.ExpertBatch`
ends and raises :class:`FileChangedError`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref

import numpy as np

from colibri import _guard
from colibri._files import (
    DIRECT_ALIGN,
    HAS_DIRECT,
    HAS_MADVISE,
    OPEN_FLAGS,
    FileChangedError,
    FileMap,
    FileReader,
    check_same,
    identity,
)
from colibri._memory import usable_memory
from colibri._units import process_memory
from colibri.formats import ExpertLayout, WeightSource
from colibri.pager._cache import _Slot
from colibri.pager._policy_base import Key

__all__ = ["DEFAULT_IO", "IO_BACKENDS", "default_io"]

Span = tuple[int, int, int]  # (file index, first page, end page): pages an expert touches

#: The ``io=`` choices.
IO_BACKENDS = ("mmap", "view", "read")
#: The default ``io=`` where the memory this process may use holds the weight files (else
#: ``"read"``: :func:`default_io`).
DEFAULT_IO = "mmap" if HAS_MADVISE else "view"


def _pmd_bytes() -> int:
    """The largest unit the kernel maps a file in on a fault (a PMD-sized folio)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


_MAP_WINDOW = _pmd_bytes()
#: Where ``io="view"`` mappings may start (64 KiB on Windows; tests set it to emulate that).
_VIEW_GRANULARITY = mmap.ALLOCATIONGRANULARITY


def _spans(layout: ExpertLayout, page_size: int, index: dict[str, int]) -> tuple[Span, ...]:
    """The page runs ``(file, first, end)`` an expert's matrices touch, merged per file."""
    runs: dict[int, list[list[int]]] = {}
    for ref in layout.matrices:
        if ref.nbytes:
            first, end = ref.offset // page_size, -(-(ref.offset + ref.nbytes) // page_size)
            runs.setdefault(index[ref.path], []).append([first, end])
    out: list[Span] = []
    for f, pieces in sorted(runs.items()):
        pieces.sort()
        merged = [pieces[0]]
        for first, end in pieces[1:]:
            if first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([first, end])
        out += [(f, first, end) for first, end in merged]
    return tuple(out)


def _cache_short(nbytes: int) -> bool:
    """Whether the memory this process may use in all cannot hold ``nbytes`` of files in the
    page cache beside what it holds now (False where the OS says nothing)."""
    in_use = process_memory().rss or 0
    limit = usable_memory(in_use)
    return limit is not None and limit.nbytes - in_use < nbytes


def default_io(paths) -> str:
    """The ``io=`` a pager of the files ``paths`` takes by default: :data:`DEFAULT_IO`, or
    ``"read"`` (direct reads) where the memory this process may use cannot hold the files.
    There every miss reads the disk anyway, and a read around the page cache streams at the
    device's rate without filling the limit (a mapping's faults or a buffered read fill it,
    then wait for the kernel to reclaim it: on a 2 GB/s drive, half the rate)."""
    if not HAS_DIRECT:
        return DEFAULT_IO
    return "read" if _cache_short(sum(os.path.getsize(p) for p in paths)) else DEFAULT_IO


def _guarded(m: FileMap) -> int:
    """Register ``m``'s mapping with the ``SIGBUS`` guard until it is unmapped (its array, which
    every view holds, dies first); the guard's index, -1 when unguarded."""
    index = _guard.register(m.address, m.length)
    if index >= 0:
        weakref.finalize(m.array, _guard.unregister, index)
    return index


def _zero_runs(counts: np.ndarray, base: int) -> list[tuple[int, int]]:
    """``[first, end)`` runs of zeros in ``counts``, offset by ``base``."""
    zero = counts == 0
    if not zero.any():
        return []
    if zero.all():
        return [(base, base + len(counts))]
    edges = np.diff(np.concatenate(([0], zero.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(base + int(s), base + int(e)) for s, e in zip(starts, ends, strict=True)]


class _IO:
    """A backend: how a slot's expert becomes readable. ``claim``/``release`` (lock held)
    account pages; ``fetch`` (lock not held) does the I/O; ``settle`` (lock held) follows a
    successful fetch; ``owners`` says where each matrix lies for views."""

    name = ""

    def __init__(
        self, source: WeightSource, page_size: int, spans: dict[Key, tuple[Span, ...]]
    ) -> None:
        self.paths = source.files
        self.page_size = page_size
        self.spans = spans
        self.experts = source.experts
        self.sizes: list[int] = []
        self.identities: list[tuple[int, int, int, int]] = []

    def _record(self, fd: int, path: str) -> None:
        """Remember what ``path`` (open as ``fd``) is; refuse a file already shorter than its
        experts need."""
        ident = identity(fd)
        need = max(
            (r.offset + r.nbytes for lay in self.experts.values() for r in lay.matrices
             if r.path == path),
            default=0,
        )  # fmt: skip
        if ident[2] < need:
            raise FileChangedError(
                f"Pager(): weight file {path!r} must hold {need} bytes as its header says "
                f"(got {ident[2]}); it was truncated after it was opened"
            )
        self.identities.append(ident)
        self.sizes.append(ident[2])

    def check(self, files, where: str = "load()") -> None:
        """:class:`FileChangedError` unless every file index in ``files`` is unchanged."""
        for f in files:
            check_same(self.paths[f], self.identities[f], where)

    def claim(self, slot: _Slot, key: Key) -> int:
        raise NotImplementedError

    def fetch(self, slot: _Slot, key: Key) -> None:
        raise NotImplementedError

    def settle(self, slot: _Slot, key: Key) -> None:
        pass

    def release(self, slot: _Slot, key: Key) -> int:
        raise NotImplementedError

    def owners(self, slot: _Slot, key: Key) -> list[tuple[np.ndarray, int, int]]:
        """``(owner array, its address, byte offset in it)`` of each of ``layout.matrices``."""
        raise NotImplementedError

    def faulted(self, slot: _Slot, key: Key) -> str | None:
        """The path of a file whose mapping ``key`` is read through read past the file's end
        (the guard put zeros there), or None."""
        return None

    def any_faulted(self) -> bool:
        """False when no :meth:`faulted` can answer a path: one check for a step's experts
        (True where only asking each can tell)."""
        return type(self).faulted is not _IO.faulted

    def close(self, slots: list[_Slot]) -> None:
        raise NotImplementedError

    def advise(self, key: Key) -> bool:
        """Start the OS reading ``key``'s bytes into its page cache; nothing is mapped or
        held (False where this backend cannot)."""
        return False


class _ReadIO(_IO):
    """Explicit reads into a pool of ``num_slots x slot_bytes`` bytes; around the page cache
    (``O_DIRECT``, reads aligned to :data:`DIRECT_ALIGN` bytes) where the memory this process
    may use cannot hold the files: there the page cache would only fill the limit, and each
    later read wait for the kernel to reclaim it."""

    name = "read"

    def __init__(
        self,
        source: WeightSource,
        page_size: int,
        spans: dict[Key, tuple[Span, ...]],
        num_slots: int,
        slot_bytes: int,
        populate: bool,
    ) -> None:
        super().__init__(source, page_size, spans)
        self.slot_bytes = slot_bytes
        self.reader = FileReader(self.paths, direct=True)
        try:
            for p in self.paths:
                self._record(self.reader.fileno(p), p)
        except BaseException:
            self.reader.close()
            raise
        self.direct = slot_bytes % DIRECT_ALIGN == 0 and _cache_short(sum(self.sizes))
        # an anonymous mapping: page-aligned (direct reads need it), committed as slots are used
        private = {}
        if hasattr(mmap, "MAP_PRIVATE"):  # not shared memory (POSIX)
            private["flags"] = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self.pool = np.frombuffer(mmap.mmap(-1, num_slots * slot_bytes, **private), np.uint8)
        self.address = self.pool.ctypes.data
        if populate:  # a non-zero byte a page: the kernel may drop zero-filled pages again
            self.pool[:: mmap.PAGESIZE] = 1
        # reads that fill a slot ((path, file offset, slot offset, nbytes, bytes needed),
        # direct or not) and where each matrix lies in the slot
        self.plans: dict[Key, tuple[list[tuple[str, int, int, int, int]], bool, tuple]] = {}

    def _plan(self, key: Key) -> tuple[list[tuple[str, int, int, int, int]], bool, tuple]:
        """The reads of ``key``: gate|up|down back to back, adjacent ranges merged so that a
        contiguous expert is one read; for direct reads each range widened to aligned ends
        (unless the widened ranges do not fit a slot)."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        merged: list[list] = []  # [path, offset, nbytes]
        where = []  # each matrix's range and offset in it
        for ref in self.experts[key].matrices:
            last = merged[-1] if merged else None
            if not (last and last[0] == ref.path and last[1] + last[2] == ref.offset):
                last = [ref.path, ref.offset, 0]
                merged.append(last)
            where.append((len(merged) - 1, ref.offset - last[1]))
            last[2] += ref.nbytes
        direct = self.direct and all(self.reader.direct(path) for path, _, _ in merged)
        for a in (DIRECT_ALIGN, 1) if direct else (1,):
            reads, at = [], 0
            for path, offset, nbytes in merged:
                first = offset - offset % a
                size = -(-(offset + nbytes - first) // a) * a
                reads.append((path, first, at, size, offset + nbytes - first))
                at += size
            if at <= self.slot_bytes:
                break
        starts = [at + offset - first for (_, first, at, _, _), (_, offset, _) in
                  zip(reads, merged, strict=True)]  # fmt: skip
        rel = tuple(starts[i] + within for i, within in where)
        plan = self.plans[key] = (reads, a > 1, rel)
        return plan

    def claim(self, slot, key):
        return -(-self.experts[key].nbytes // self.page_size)

    release = claim

    def fetch(self, slot, key):
        reads, direct, _ = self._plan(key)
        base = memoryview(self.pool)[slot.index * self.slot_bytes :]
        try:
            for path, offset, at, nbytes, need in reads:
                self.reader.readinto(path, offset, base[at : at + nbytes], need=need,
                                     direct=direct)  # fmt: skip
        finally:
            base.release()

    def owners(self, slot, key):
        base, pool = slot.index * self.slot_bytes, self.pool
        return [(pool, self.address, base + r) for r in self._plan(key)[2]]

    def close(self, slots):
        self.reader.close()  # the pool lives on in the views that still use it

    def advise(self, key):
        if self._plan(key)[1]:  # direct reads do not read the page cache: nothing to warm
            return False
        done = [self.reader.advise(r.path, r.offset, r.nbytes) for r in self.experts[key].matrices]
        return all(done)


class _PageTable:
    """How many resident experts use each page of one file (no Python object per page)."""

    def __init__(self, num_pages: int, most_sharing: int) -> None:
        dtype = np.uint8 if most_sharing < 255 else np.uint16 if most_sharing < 65535 else np.uint32
        self.count = np.zeros(num_pages, dtype)

    def hold(self, first: int, end: int) -> int:
        """One more user of pages ``[first, end)``; the number that had none."""
        seg = self.count[first:end]
        new = int(np.count_nonzero(seg == 0))
        seg += 1
        return new

    def unhold(self, first: int, end: int) -> list[tuple[int, int]]:
        """One user fewer; the runs of pages left with none."""
        seg = self.count[first:end]
        seg -= 1
        return _zero_runs(seg, first)


class _MapIO(_IO):
    """One read-only mapping per file, pages counted per file in a :class:`_PageTable`."""

    name = "mmap"

    def __init__(
        self, source: WeightSource, page_size: int, spans: dict[Key, tuple[Span, ...]]
    ) -> None:
        super().__init__(source, page_size, spans)
        self.maps: list[FileMap | None] = []
        self.guards: list[int] = []  # the SIGBUS guard's index of each file's mapping
        try:
            for p in self.paths:
                fd = os.open(p, OPEN_FLAGS)
                try:  # the mapping keeps its own descriptor
                    self._record(fd, p)
                    m = FileMap(p, fd, 0, self.sizes[-1]) if self.sizes[-1] else None
                    self.maps.append(m)
                    self.guards.append(-1 if m is None else _guarded(m))
                finally:
                    os.close(fd)
        except BaseException:
            self.close([])
            raise
        smallest = min((r.nbytes for lay in self.experts.values() for r in lay.matrices
                        if r.nbytes), default=1)  # fmt: skip
        sharing = self.page_size // smallest + 2  # experts that can touch one page
        self.tables = [_PageTable(-(-s // self.page_size), sharing) for s in self.sizes]
        self.window = max(1, _MAP_WINDOW // self.page_size)  # pages the kernel may map at once
        self.index = {p: i for i, p in enumerate(self.paths)}
        self.where: dict[Key, list[tuple[int, int]]] = {}  # (file, offset) of each matrix
        self.pageout = _cache_short(sum(self.sizes))  # evicted pages leave the page cache

    def claim(self, slot, key):
        return sum(self.tables[f].hold(first, end) for f, first, end in self.spans[key])

    def fetch(self, slot, key):
        ps = self.page_size
        for f, first, end in self.spans[key]:
            self.maps[f].populate(first * ps, (end - first) * ps)

    def advise(self, key):
        ps = self.page_size
        return all([self.maps[f].advise(first * ps, (end - first) * ps)
                    for f, first, end in self.spans[key]])  # fmt: skip

    def _drop(self, f: int, runs, pageout: bool = False) -> None:
        ps = self.page_size
        for first, end in runs:
            self.maps[f].drop(first * ps, (end - first) * ps, pageout=pageout)

    def settle(self, slot, key):
        # The kernel maps whole page-cache folios on a fault: drop what it mapped beyond.
        w = self.window
        if w == 1:
            return
        for f, first, end in self.spans[key]:
            table = self.tables[f].count
            lo, hi = first - first % w, min(-(-end // w) * w, len(table))
            self._drop(f, _zero_runs(table[lo:first], lo) + _zero_runs(table[end:hi], end))

    def release(self, slot, key):
        freed = 0
        for f, first, end in self.spans[key]:
            runs = self.tables[f].unhold(first, end)
            self._drop(f, runs, self.pageout)
            freed += sum(e - s for s, e in runs)
        return freed

    def owners(self, slot, key):
        where = self.where.get(key)
        if where is None:
            where = self.where[key] = [
                (self.index[r.path], r.offset) for r in self.experts[key].matrices
            ]
        maps = self.maps
        return [(maps[f].array, maps[f].address, offset) for f, offset in where]

    def faulted(self, slot, key):
        for f, _, _ in self.spans[key]:
            if _guard.faulted(self.guards[f]):
                return self.paths[f]
        return None

    def any_faulted(self):
        return any(_guard.faulted(g) for g in self.guards)  # one mapping a file

    def close(self, slots):
        for m in self.maps:
            if m is not None:
                with contextlib.suppress(OSError):
                    m.drop(0, m.length)  # live views re-fault from the file
                m.close()


class _ViewIO(_IO):
    """A mapping per resident expert and page run, unmapped on eviction (Windows' way)."""

    name = "view"

    def __init__(
        self, source: WeightSource, page_size: int, spans: dict[Key, tuple[Span, ...]]
    ) -> None:
        super().__init__(source, page_size, spans)
        self.fds: list[int] = []
        self.lock = threading.Lock()
        self.closed = False
        try:
            for p in self.paths:
                self.fds.append(os.open(p, OPEN_FLAGS))
                self._record(self.fds[-1], p)
        except BaseException:
            self.close([])
            raise
        self.granularity = max(_VIEW_GRANULARITY, mmap.ALLOCATIONGRANULARITY)

    def claim(self, slot, key):
        return sum(end - first for _, first, end in self.spans[key])

    def fetch(self, slot, key):
        ps, maps = self.page_size, []
        try:
            for f, first, end in self.spans[key]:
                start, stop = first * ps, min(end * ps, self.sizes[f])
                offset = start - start % self.granularity
                with self.lock:  # never map from a descriptor close() is closing
                    if self.closed:
                        raise ValueError("the Pager was closed during this load")
                    m = FileMap(self.paths[f], self.fds[f], offset, stop - offset)
                maps.append((m, _guarded(m)))
                m.populate(start - offset, stop - start)
                m.drop(0, start - offset)  # the kernel may have mapped the rounded-down part
        except BaseException:
            for m, _ in maps:
                m.close()
            raise
        slot.io = maps

    def release(self, slot, key):
        for m, _ in slot.io or ():
            m.close()  # views still alive (only after Pager.close) keep theirs
        slot.io = None
        return self.claim(slot, key)  # the same pages

    def owners(self, slot, key):
        out = []
        for ref in self.experts[key].matrices:
            for m, _ in slot.io:
                if m.path == ref.path and m.offset <= ref.offset <= m.offset + m.length:
                    out.append((m.array, m.address, ref.offset - m.offset))
                    break
        return out

    def faulted(self, slot, key):
        for m, index in slot.io or ():
            if _guard.faulted(index):
                return m.path
        return None

    def close(self, slots):
        for slot in slots:
            for m, _ in slot.io or ():
                with contextlib.suppress(OSError):
                    m.drop(0, m.length)  # live views re-fault from the file
                m.close()
            slot.io = None
        with self.lock:
            self.closed = True
            fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)
