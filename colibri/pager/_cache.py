"""The pager's slots and the state they share with pins and the prefetch thread.

A slot holds one resident expert, or one being fetched (``_LOADING``, then ``_READY`` or
``_FAILED``). Its pins are counted per holder: the thread whose load made them (its views keep
them, whichever thread drops the last view), or ``PREFETCH`` for a queued prefetch. A load
that finds every slot pinned waits for the pins of other holders to go, but not for its own
thread's, which could never go while it waits.

``_Cache`` holds what pins and the prefetch thread share with the Pager, behind one lock: the
slots, what is where, which slots are free, whether the pager is closed, the counters. Pins
(:mod:`colibri.pager._views`) and the prefetch thread hold the cache, never the
:class:`~colibri.pager.Pager`, so that a dropped Pager is collected.
"""

from __future__ import annotations

import threading

from colibri.pager._policy_base import Key
from colibri.pager._stats import PagerStats

_EMPTY, _LOADING, _READY, _FAILED = 0, 1, 2, 3
#: The holder of a queued prefetch's pin (thread idents are positive).
PREFETCH = -1


class _Slot:
    __slots__ = (
        "error", "event", "holders", "index", "io", "key", "nbytes", "pages", "pins",
        "prefetched", "reading", "state",
    )  # fmt: skip

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: Key | None = None
        self.state = _EMPTY
        self.pins = 0
        self.holders: dict[int, int] = {}  # pins per holder (thread ident or PREFETCH)
        self.nbytes = 0
        self.pages = 0  # pages claimed and not yet given back, for the stats
        self.io = None  # backend data (view: the slot's mappings)
        self.event: threading.Event | None = None
        self.error: BaseException | None = None
        self.prefetched = False
        self.reading = False  # a read was started or queued: the slot will leave _LOADING


class _Cache:
    """All mutable pager state, shared with pins and the prefetch thread (not the Pager)."""

    def __init__(self, num_slots: int, stats: PagerStats) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # a slot was read, failed or unpinned
        self.slots = [_Slot(i) for i in range(num_slots)]
        self.free = list(range(num_slots - 1, -1, -1))
        self.where: dict[Key, _Slot] = {}
        self.closed = False
        self.stats = stats  # resident_* and peak_* fields are live here

    def pin(self, slot: _Slot, holder: int) -> None:
        """One more pin of ``holder`` on ``slot`` (lock held)."""
        slot.pins += 1
        slot.holders[holder] = slot.holders.get(holder, 0) + 1

    def unpin(self, slot: _Slot, holder: int) -> None:
        """Drop one pin of ``holder``; a failed slot goes back to the free list with its last
        pin."""
        with self.lock:
            slot.pins -= 1
            left = slot.holders.pop(holder) - 1
            if left:
                slot.holders[holder] = left
            self.changed.notify_all()
            if slot.pins == 0 and slot.state == _FAILED:
                slot.state, slot.key = _EMPTY, None
                self.free.append(slot.index)
