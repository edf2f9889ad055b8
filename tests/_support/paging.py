"""Helpers for the pager tests: hooks on every I/O syscall, and what /proc says is mapped."""

from __future__ import annotations

import mmap
import os
import re

from colibri._files import MADV_PAGEOUT, MADV_POPULATE_READ, FileMap, FileReader

_KINDS = {mmap.MADV_DONTNEED: "drop"} if hasattr(mmap, "MADV_DONTNEED") else {}
if hasattr(mmap, "MADV_WILLNEED"):
    _KINDS[mmap.MADV_WILLNEED] = "willneed"
    _KINDS[mmap.MADV_RANDOM] = "random"
if MADV_POPULATE_READ is not None:
    _KINDS[MADV_POPULATE_READ] = "populate"
if MADV_PAGEOUT is not None:
    _KINDS[MADV_PAGEOUT] = "pageout"


def hook_io(monkeypatch, before):
    """Call ``before(kind, path, offset, length)`` ahead of every syscall that moves expert
    bytes: ``kind`` is ``"read"`` (a positional read; returning an int shortens it to that
    many bytes), ``"willneed"``, ``"populate"``, ``"random"``, ``"pageout"`` or ``"drop"``
    (madvise of a mapping).
    ``before`` may raise to inject a fault, or block."""
    real_pread, real_advise = FileReader._pread, FileMap._advise

    def pread(self, path, view, offset, direct=False):
        limit = before("read", path, offset, len(view))
        if limit is not None:
            view = view[:limit]
        return real_pread(self, path, view, offset, direct)

    def advise(self, option, start, length):
        before(_KINDS.get(option, str(option)), self.path, self.offset + start, length)
        return real_advise(self, option, start, length)

    monkeypatch.setattr(FileReader, "_pread", pread)
    monkeypatch.setattr(FileMap, "_advise", advise)


_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ \d+\s+(.*)$")


def mappings(path):
    """``[(start, end, file_offset)]`` of this process's mappings of ``path`` (Linux)."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            m = _VMA.match(line.rstrip("\n"))
            if m and m[4] == real:
                out.append((int(m[1], 16), int(m[2], 16), int(m[3], 16)))
    return out


def mapped_rss(path):
    """Bytes of ``path`` mapped into this process right now (Rss of its mappings, Linux)."""
    real = os.path.realpath(path)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = _VMA.match(line.rstrip("\n"))
            if m:
                inside = m[4] == real
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def held_pages(source, keys, page_size, io):
    """Pages the pager should hold for resident ``keys``, computed from the layouts alone:
    the union of the file pages they touch (mmap), their sum per expert (view), or the pool
    pages their bytes fill (read)."""
    if io == "read":
        return sum(-(-source.experts[k].nbytes // page_size) for k in keys)
    per_expert = []
    for k in keys:
        pages = set()
        for ref in source.experts[k].matrices:
            first, end = ref.offset // page_size, -(-(ref.offset + ref.nbytes) // page_size)
            pages |= {(ref.path, p) for p in range(first, end)}
        per_expert.append(pages)
    if io == "view":
        return sum(len(p) for p in per_expert)
    return len(set().union(*per_expert))
