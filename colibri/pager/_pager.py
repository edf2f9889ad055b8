"""The Pager: expert weights paged from their files under a hard memory budget.

How it works
------------
The unit of caching is the expert: its ``gate``, ``up`` and ``down`` matrices together. The
weight files are split into pages of ``page_size_kb``; each expert touches a run of pages per
file (its byte ranges rounded out to whole pages). One *slot* is the most pages any expert
touches, and the budget holds ``budget_bytes // slot_bytes`` experts at once, whatever the
backend, so the backends see the same hits, misses and evictions for the same loads.

Backends (``io=``): ``"mmap"`` (default on Linux and macOS) maps every file once and counts
its pages, ``"view"`` (default on Windows) maps each resident expert on its own, ``"read"``
copies experts into a pool with positional reads; see :mod:`colibri.pager._backends`.

"Resident pages" are the pages the pager holds: the file pages of resident experts (mmap,
view) or the pool pages their bytes fill (read); ``resident_pages * page_size`` never exceeds
the budget. What this means for the process, as ``/proc/self/status`` counts it: mapped pages
are ``RssFile`` (clean, shared with the page cache and other processes that map the file, and
reclaimable), the read pool is ``RssAnon``; :attr:`Pager.stats` reports both. The page cache
itself is kernel memory outside every process's RSS.

:meth:`Pager.load` returns read-only numpy views that pin their expert while alive; see
:mod:`colibri.pager._views`.

The code: this module holds :class:`Pager`, ``_cache`` the slots and the state shared with
pins and the prefetch thread, ``_backends`` the I/O, ``_views`` what a load hands out,
``_stats`` the counters. This module is over 600 lines because it is one class, a third of
it docstrings: the public API, and the slot protocol (claim, fetch, fail, evict) that
``load``, ``prefetch`` and ``close`` share under one lock, which reads best in one place.
``load`` runs in phases: ``_claim`` (pin the hits, give each miss a slot), ``_read`` (fetch
the misses), ``_await`` (the hits other threads are fetching), ``_pin_views``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import threading
import time
import weakref

import numpy as np

from colibri._errors import BudgetError
from colibri._files import HAS_MADVISE, FileChangedError
from colibri._units import process_memory
from colibri._validate import check_page_size_kb
from colibri.formats import ExpertWeights, WeightSource, open_weights
from colibri.pager._backends import (
    _IO,
    DEFAULT_IO,
    IO_BACKENDS,
    _MapIO,
    _ReadIO,
    _spans,
    _ViewIO,
)
from colibri.pager._cache import _EMPTY, _FAILED, _LOADING, _READY, _Cache, _Slot
from colibri.pager._policies import CachePolicy, make_policy
from colibri.pager._policy_base import Key
from colibri.pager._replay import Trace
from colibri.pager._stats import LayerStats, PagerStats, _faults
from colibri.pager._views import ExpertBatch, _Pin, _Region

__all__ = ["BudgetError", "FileChangedError", "Pager"]


def _shutdown(cache: _Cache, backend: _IO, jobs: queue.Queue, workers: list) -> None:
    with cache.lock:
        cache.closed = True
    for worker in workers:
        if worker is threading.current_thread():  # the Pager died in its own worker
            with contextlib.suppress(queue.Full):  # else it sees the dead Pager at its next job
                jobs.put_nowait(None)
        elif worker.is_alive():
            jobs.put(None)  # the worker drains the queue, so this cannot block for ever
            worker.join()
    with cache.lock:  # no fetch is running now: the pager gives every page back
        stats = cache.stats
        for slot in cache.slots:
            if slot.pages:
                stats.pages_evicted += slot.pages
                per = stats.per_layer.get(slot.key[0]) if slot.key else None
                if per is not None:
                    per.pages_evicted += slot.pages
                slot.pages = 0
        cache.where.clear()
        stats.resident_bytes = stats.resident_pages = 0
        backend.close(cache.slots)


def _prefetch_loop(pager_ref: weakref.ref, jobs: queue.Queue) -> None:
    """Background reader: holds the Pager only while serving one job."""
    while True:
        job = jobs.get()
        pager = pager_ref() if job is not None else None
        if pager is None:
            return
        slot, key = job
        if pager.closed:
            with pager._cache.lock:
                pager._fail(slot, ValueError("the Pager was closed before this prefetch ran"))
        else:
            # the loader's pin goes with the slot turning ready (or failing): drain() never
            # sees a ready slot still pinned; an error is stored on the slot for load()
            with contextlib.suppress(BaseException):
                pager._fetch(slot, key, release=True)
        del pager


class Pager:
    """Expert weights from files, cached per expert under a hard budget of ``budget_bytes``.

    Parameters
    ----------
    source : path-like or WeightSource
        A weight file (safetensors, sharded index, GGUF, colibri raw) or an opened source.
    budget_bytes : int
        Hard limit on the pages the pager holds resident (``resident_pages * page_size``).
    page_size_kb : int
        Page size (4, 32, 64, ... KiB; a power of two, at least the OS page for ``mmap`` and
        ``view``): the unit of residency, of I/O and of the budget.
    policy : str or CachePolicy
        ``"adaptive"`` (default: the smallest gap to Belady on the bench's traces, and never
        more than a stake of hits behind LRU), ``"lru"``, ``"fifo"``, ``"lfu"``, ``"lrfu"``,
        ``"nextuse"``, ``"hot"`` (see :mod:`colibri.pager`).
    policy_options : dict, optional
        Passed to the policy (``half_life`` for lrfu; ``counts``, ``hot_fraction`` for hot).
    io : str, optional
        ``"mmap"`` (default on Linux and macOS), ``"view"`` (default on Windows) or
        ``"read"``; see the module docstring.
    prefetch_queue : int
        Bound of the background prefetch queue (experts).
    record_trace : bool
        Record every load in :attr:`trace` (for :func:`colibri.pager.belady`).
    populate : bool
        ``io="read"`` only: commit the whole pool now (one write per OS page), so that first
        reads into a slot pay no zero-fill page faults. The process's RSS then starts at the
        pool size, which is still within the budget. Default: committed as slots are used.

    Raises
    ------
    BudgetError
        The budget cannot hold one expert.
    FileChangedError
        A weight file is already shorter than its header says.

    Examples
    --------
    Eight experts of one layer in a weight file, paged under a budget of four of them (each
    expert here takes two 4 KiB pages):

    >>> import numpy as np, colibri
    >>> from colibri.formats.raw import write_experts
    >>> rng = np.random.default_rng(0)
    >>> def expert():  # gate [I, H], up [I, H], down [H, I]
    ...     return tuple(rng.standard_normal(s, np.float32) for s in ((32, 16), (32, 16), (16, 32)))
    >>> path = write_experts("experts.bin", {(0, e): expert() for e in range(8)})
    >>> pager = colibri.Pager(path, budget_bytes=4 * 8192, page_size_kb=4)
    >>> pager.capacity
    4
    >>> x = rng.standard_normal(16, np.float32)
    >>> with pager.load(0, [1, 5]) as experts:
    ...     w = experts[5]
    ...     y = w.down @ (w.gate @ x * (w.up @ x))
    ...     print(w.gate.shape, w.gate.flags.writeable, y.shape)
    (32, 16) False (16,)
    >>> pager.stats.misses, pager.stats.hits
    (2, 0)
    >>> pager.close()
    """

    def __init__(
        self,
        source: str | os.PathLike | WeightSource,
        *,
        budget_bytes: int,
        page_size_kb: int = 64,
        policy: str | CachePolicy = "adaptive",
        policy_options: dict | None = None,
        io: str | None = None,
        prefetch_queue: int = 64,
        record_trace: bool = False,
        populate: bool = False,
    ) -> None:
        page_size_kb = check_page_size_kb(page_size_kb, "Pager(): ")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
            raise TypeError(f"Pager(): budget_bytes must be an int (got {budget_bytes!r})")
        if prefetch_queue < 1:
            raise ValueError(f"Pager(): prefetch_queue must be >= 1 (got {prefetch_queue!r})")
        io = DEFAULT_IO if io is None else io
        if io not in IO_BACKENDS:
            raise ValueError(f"Pager(): io must be one of {IO_BACKENDS} (got {io!r})")
        if io == "mmap" and not HAS_MADVISE:
            raise ValueError(
                "Pager(): io must be 'view' or 'read' here (got 'mmap'): this OS has no "
                "madvise to drop a mapping's pages, so each expert needs a view of its own"
            )
        self.page_size = page_size_kb * 1024
        if io != "read" and self.page_size < mmap.PAGESIZE:
            raise ValueError(
                f"Pager(): page_size_kb must be at least the OS page, "
                f"{mmap.PAGESIZE // 1024}, for io={io!r} (got {page_size_kb})"
            )
        self.source = open_weights(source)
        self.budget_bytes = int(budget_bytes)
        index = {p: i for i, p in enumerate(self.source.files)}
        self._spans = {
            key: _spans(layout, self.page_size, index)
            for key, layout in self.source.experts.items()
        }
        self._files = {key: {f for f, _, _ in spans} for key, spans in self._spans.items()}
        self._all_files = set(range(len(self.source.files)))
        self._single_file = len(self._all_files) == 1
        most = max(sum(end - first for _, first, end in s) for s in self._spans.values())
        slot_bytes = max(most, 1) * self.page_size
        num_slots = self.budget_bytes // slot_bytes
        if num_slots < 1:
            largest = self.source.max_expert_nbytes
            raise BudgetError(
                f"Pager(): budget_bytes={self.budget_bytes} cannot hold one expert "
                f"({largest} bytes, touching {most} pages of {page_size_kb} KiB); "
                f"raise the budget to at least {slot_bytes}"
            )
        self._slot_bytes = slot_bytes
        stats = PagerStats(io=io, page_size=self.page_size, budget_bytes=self.budget_bytes,
                           pool_bytes=num_slots * slot_bytes if io == "read" else 0)  # fmt: skip
        self._cache = _Cache(num_slots, stats)
        if io == "read":
            self._io: _IO = _ReadIO(
                self.source, self.page_size, self._spans, num_slots, slot_bytes, populate
            )
        else:
            backend = _MapIO if io == "mmap" else _ViewIO
            self._io = backend(self.source, self.page_size, self._spans)
        self._policy = make_policy(policy, num_slots, **(policy_options or {}))
        self._usage: dict[Key, int] = {}
        self.trace: Trace | None = Trace() if record_trace else None
        self._jobs: queue.Queue = queue.Queue(maxsize=prefetch_queue)
        self._workers: list[threading.Thread] = []
        self._finalizer = weakref.finalize(
            self, _shutdown, self._cache, self._io, self._jobs, self._workers
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Number of experts the budget holds at once (slots)."""
        return len(self._cache.slots)

    @property
    def slot_bytes(self) -> int:
        """Bytes charged to one resident expert: the most pages any expert touches."""
        return self._slot_bytes

    @property
    def io(self) -> str:
        """The backend: ``"mmap"``, ``"view"`` or ``"read"``."""
        return self._io.name

    @property
    def policy(self) -> str:
        """Name of the current cache policy."""
        return self._policy.name

    @property
    def closed(self) -> bool:
        return self._cache.closed

    @property
    def stats(self) -> PagerStats:
        """A snapshot of the counters (and of the process's RSS)."""
        with self._cache.lock:
            s = self._cache.stats
            snap = PagerStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})
            snap.per_layer = {k: LayerStats(**vars(v)) for k, v in s.per_layer.items()}
        memory = process_memory()
        snap.rss_file, snap.rss_anon = memory.file, memory.anon
        return snap

    def reset_stats(self) -> None:
        """Zero the counters (resident levels stay; peaks restart from them)."""
        with self._cache.lock:
            old = self._cache.stats
            self._cache.stats = PagerStats(
                io=old.io, page_size=old.page_size, budget_bytes=old.budget_bytes,
                pool_bytes=old.pool_bytes, resident_bytes=old.resident_bytes,
                peak_resident_bytes=old.resident_bytes, resident_pages=old.resident_pages,
                peak_resident_pages=old.resident_pages,
            )  # fmt: skip

    def usage(self) -> dict[Key, int]:
        """Demand accesses per ``(layer, expert)`` since construction (for the ``hot`` policy)."""
        with self._cache.lock:
            return dict(self._usage)

    def resident(self) -> list[Key]:
        """Keys of the experts now held (loaded or loading)."""
        with self._cache.lock:
            return sorted(self._cache.where)

    def pinned(self) -> list[Key]:
        """Keys of the experts that live views (or loads in progress) keep from eviction."""
        with self._cache.lock:
            return sorted(s.key for s in self._cache.slots if s.pins and s.key is not None)

    # -- policy -------------------------------------------------------------------------------

    def set_cache_policy(self, policy: str | CachePolicy, **options) -> None:
        """Switch the eviction policy now; resident experts stay, in the old eviction order.

        ``policy`` is a name of :data:`colibri.pager.POLICIES` or a
        :class:`~colibri.pager.CachePolicy`; ``options`` go to its constructor.
        """
        new = make_policy(policy, self.capacity, **options)
        with self._cache.lock:
            for key in self._policy.eviction_order():
                new.insert(key)
            self._policy = new

    # -- loading ------------------------------------------------------------------------------

    def _keys(self, layer: int, expert_ids, where: str) -> list[Key]:
        ids = np.asarray(expert_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{where}: expert ids must be integers (got dtype {ids.dtype})")
        keys = [(int(layer), int(e)) for e in np.unique(ids.ravel())]
        for key in keys:
            self.source.layout(*key)  # KeyError naming the valid range
        return keys

    def _step_files(self, keys: list[Key]) -> set[int]:
        return set().union(*(self._files[k] for k in keys))

    def _check_open(self) -> None:
        if self._cache.closed:
            raise ValueError("this Pager is closed")

    def _layer(self, layer: int) -> LayerStats:
        per = self._cache.stats.per_layer.get(layer)
        if per is None:
            per = self._cache.stats.per_layer[layer] = LayerStats()
        return per

    def _take_slot(self, step: set[Key]) -> _Slot | None:
        """A free slot, or the policy's victim among unpinned loaded experts (lock held)."""
        # close() may have run while this call waited for a slot: it gave every page back and
        # emptied `where`, so the policy's keys no longer name slots
        self._check_open()
        cache = self._cache
        if cache.free:
            return cache.slots[cache.free.pop()]

        def evictable(key: Key) -> bool:
            slot = cache.where[key]
            return slot.pins == 0 and slot.state == _READY and key not in step

        victim = self._policy.victim(evictable)
        if victim is None:
            return None
        self._policy.remove(victim)
        slot = cache.where.pop(victim)
        self._forget(slot)
        cache.stats.evictions += 1
        self._layer(victim[0]).evictions += 1
        slot.state, slot.key = _EMPTY, None
        return slot

    def _assign(self, slot: _Slot, key: Key) -> None:
        cache, stats = self._cache, self._cache.stats
        slot.key, slot.state, slot.pins, slot.error = key, _LOADING, 1, None
        slot.event = threading.Event()
        slot.nbytes = self.source.experts[key].nbytes
        slot.prefetched = slot.reading = False
        cache.where[key] = slot
        pages = slot.pages = self._io.claim(slot, key)
        stats.pages_loaded += pages
        self._layer(key[0]).pages_loaded += pages
        stats.resident_bytes += slot.nbytes
        stats.resident_pages += pages
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)
        stats.peak_resident_pages = max(stats.peak_resident_pages, stats.resident_pages)
        self._policy.insert(key)

    def _forget(self, slot: _Slot, *, failed: bool = False) -> None:
        """Give back the pages and bytes of ``slot``'s expert (lock held). A failed load's
        pages were never loaded: they come off ``pages_loaded``, not onto ``pages_evicted``."""
        stats, per = self._cache.stats, self._layer(slot.key[0])
        freed = self._io.release(slot, slot.key)
        if failed:
            stats.pages_loaded -= freed
            per.pages_loaded -= freed
        else:
            stats.pages_evicted += freed
            per.pages_evicted += freed
        stats.resident_pages -= freed
        stats.resident_bytes -= slot.nbytes
        slot.pages = 0

    def _fetch(self, slot: _Slot, key: Key, *, release: bool = False) -> None:
        """Make ``key`` readable in ``slot`` (lock not held); mark it ready or failed. With
        ``release``, the loader's pin is dropped in the same step as it turns ready (a
        failure drops it always)."""
        cache = self._cache
        faults = _faults()
        start = time.perf_counter()
        try:
            self._io.check(self._files[key])
            try:
                self._io.fetch(slot, key)
            except OSError:
                self._io.check(self._files[key])  # a changed file explains the error best
                raise
        except BaseException as exc:
            with cache.lock:
                self._fail(slot, exc)
            raise
        elapsed = time.perf_counter() - start
        minor, major = (b - a for a, b in zip(faults, _faults(), strict=True))
        with cache.lock:
            self._io.settle(slot, key)
            stats, per = cache.stats, self._layer(key[0])
            slot.state = _READY
            stats.bytes_read += slot.nbytes
            stats.read_seconds += elapsed
            per.bytes_read += slot.nbytes
            for s in (stats, per):
                s.minor_faults += minor
                s.major_faults += major
            slot.event.set()
            cache.changed.notify_all()
            if release:
                cache.unpin(slot)

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        """A fetch into ``slot`` failed or was abandoned: forget the expert, give its pages
        back, wake waiters and drop the loader's pin; the slot is recycled with its last pin
        (lock held)."""
        cache = self._cache
        if cache.where.get(slot.key) is slot:
            del cache.where[slot.key]
            self._policy.remove(slot.key)
            if not cache.closed:  # close() already took every page back
                self._forget(slot, failed=True)
        slot.error, slot.state = exc, _FAILED
        slot.event.set()
        cache.unpin(slot)

    def _views(self, slot: _Slot) -> ExpertWeights:
        """Views of a ready slot's matrices; they own this call's pin."""
        layout = self.source.experts[slot.key]
        pin = _Pin(self._cache, slot)
        owners = self._io.owners(slot, slot.key)
        regions: dict[int, np.ndarray] = {}
        buffers = []
        for ref, (owner, address, at) in zip(layout.matrices, owners):  # noqa: B905 (3 and 3)
            whole = regions.get(address)
            if whole is None:  # usually one region: the expert's owner holds all three
                if owner is None:
                    raise ValueError("this Pager was closed during the load")
                whole = regions[address] = np.asarray(_Region(owner, address, pin))
            buffers.append(whole[at : at + ref.nbytes])
        return layout.weights(buffers)

    def load(self, layer: int, expert_ids) -> ExpertBatch:
        """Make the experts of one routing step resident and return views of their weights.

        Parameters
        ----------
        layer : int
            Layer index.
        expert_ids : array-like of int
            Any shape, e.g. ``ids [T, k]`` from ``ctx.route``; each unique expert is fetched
            at most once (the batch union), hits first, then misses in ascending id order.

        Returns
        -------
        ExpertBatch
            ``batch[e].gate``, ``.up``, ``.down``: read-only numpy arrays pinned while alive
            (views into the file mapping for ``io="mmap"``/``"view"``, into the pool for
            ``"read"``).

        Raises
        ------
        KeyError
            An expert that the file does not hold.
        BudgetError
            More unique experts than slots, or every slot pinned by live views.
        FileChangedError
            A weight file of these experts was truncated, replaced or modified since open.
        OSError
            Reading failed (a disk error); the message names the file and the byte range.
            The pager stays usable: the experts that failed are not resident.
        """
        self._check_open()
        keys = self._keys(layer, expert_ids, "load()")
        layer = int(layer)
        if len(keys) > self.capacity:
            raise BudgetError(
                f"load(): {len(keys)} unique experts requested but the budget holds "
                f"{self.capacity} ({self.slot_bytes} bytes each); raise budget_bytes"
            )
        self._io.check(self._all_files if self._single_file else self._step_files(keys))
        ready, wait, mine = self._claim(layer, keys)
        fetched, error = self._read(mine)
        waited, failed = self._await(wait)
        done = ready + fetched + waited
        if error is None:
            error = failed  # this load's own read error, if any, comes first
        if error is not None:
            for slot in done:
                self._cache.unpin(slot)
            raise error
        return ExpertBatch(layer, self._pin_views(done))

    # The phases of a load. Each slot they pass on carries one pin of this load, which the
    # next phase hands on, gives back, or turns into the views' pin.

    def _claim(self, layer: int, keys: list[Key]) -> tuple[list[_Slot], list[_Slot], list[_Slot]]:
        """Pin every expert of the step, under the lock: hits first, then a slot per miss.

        Returns
        -------
        ready, wait, mine : list of _Slot
            Hits whose expert is readable; hits another thread is still fetching; misses,
            each in a slot of its own (the policy's victim evicted) that this load fetches.

        Raises
        ------
        BudgetError
            Every slot is pinned by live views; this load's pins are dropped and its slots
            failed first.
        """
        cache = self._cache
        step = set(keys)
        ready: list[_Slot] = []
        wait: list[_Slot] = []
        mine: list[_Slot] = []
        with cache.lock:
            self._check_open()
            if self.trace is not None:
                self.trace.steps.append((layer, tuple(e for _, e in keys)))
            stats, per = cache.stats, self._layer(layer)
            self._policy.begin_step(layer, keys)
            missed = []
            for key in keys:
                self._usage[key] = self._usage.get(key, 0) + 1
                slot = cache.where.get(key)
                if slot is None:
                    missed.append(key)
                else:
                    (ready if self._hit(slot, stats, per) else wait).append(slot)
            for key in missed:
                while True:
                    slot = cache.where.get(key)
                    if slot is not None:  # another thread loaded it while we waited
                        (ready if self._hit(slot, stats, per) else wait).append(slot)
                        break
                    slot = self._take_slot(step)
                    if slot is not None:
                        self._assign(slot, key)
                        stats.misses += 1
                        per.misses += 1
                        mine.append(slot)
                        break
                    # Every slot is pinned. Reads in progress (or queued prefetches) will
                    # free some; otherwise live views hold them all.
                    if any(x.state == _LOADING and x.pins and x.reading for x in cache.slots):
                        cache.changed.wait(1.0)
                        continue
                    for x in ready + wait:
                        cache.unpin(x)
                    for x in mine:
                        self._fail(x, BudgetError("load() was abandoned"))
                    raise BudgetError(
                        f"load(): every one of the {self.capacity} slots is pinned by live "
                        "expert views; release ExpertBatch handles (or drop kept views) or "
                        "raise budget_bytes"
                    )
            for slot in mine:  # fetched right after the lock is released
                slot.reading = True
        return ready, wait, mine

    def _hit(self, slot: _Slot, stats: PagerStats, per: LayerStats) -> bool:
        """Count a demand hit on ``slot`` and pin it (lock held); True if its expert is
        readable, False if another thread is still fetching it."""
        stats.hits += 1
        per.hits += 1
        self._policy.touch(slot.key)
        slot.pins += 1
        if slot.prefetched:
            slot.prefetched = False
            stats.prefetch_hits += 1
        if slot.state == _READY:
            return True
        stats.inflight_waits += 1
        return False

    def _read(self, mine: list[_Slot]) -> tuple[list[_Slot], BaseException | None]:
        """Fetch this load's misses in order (lock not held); after the first error the rest
        are failed unread. Returns the slots fetched and that error (None if none)."""
        fetched: list[_Slot] = []
        error: BaseException | None = None
        for slot in mine:
            if error is None:
                try:
                    self._fetch(slot, slot.key)
                    fetched.append(slot)
                except BaseException as exc:  # _fetch already failed the slot
                    error = exc
            else:
                with self._cache.lock:
                    self._fail(slot, error)
        return fetched, error

    def _await(self, wait: list[_Slot]) -> tuple[list[_Slot], BaseException | None]:
        """Wait for the hits other threads are fetching; a failed one's pin is dropped.
        Returns the slots now readable and the first error (None if none)."""
        readable: list[_Slot] = []
        error: BaseException | None = None
        for slot in wait:
            slot.event.wait()
            if slot.error is None:
                readable.append(slot)
            else:
                error = error or slot.error
                self._cache.unpin(slot)
        return readable, error

    def _pin_views(self, done: list[_Slot]) -> dict[int, ExpertWeights]:
        """The experts' views by id, ascending; each adopts this load's pin on its slot. If
        one cannot be made, the pins not yet adopted are dropped."""
        experts = {}
        try:
            while done:
                slot = done.pop()
                experts[slot.key[1]] = self._views(slot)  # adopts this call's pin
        except BaseException:
            for slot in done:
                self._cache.unpin(slot)
            raise
        return dict(sorted(experts.items()))

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, layer: int, expert_ids) -> int:
        """Announce experts likely needed soon; a background thread fetches them.

        Experts already resident or in flight are skipped; a later :meth:`load` of an expert
        in flight waits for that fetch instead of fetching again. Never blocks: when the
        bounded queue is full, or no slot is evictable, the rest of the request is dropped.

        Returns
        -------
        int
            How many fetches were queued.
        """
        self._check_open()
        keys = self._keys(layer, expert_ids, "prefetch()")
        cache = self._cache
        queued = 0
        with cache.lock:
            self._check_open()
            if not self._workers:
                worker = threading.Thread(
                    target=_prefetch_loop,
                    args=(weakref.ref(self), self._jobs),
                    name="colibri-prefetch",
                    daemon=True,
                )
                worker.start()
                self._workers.append(worker)
            for key in keys:
                if key in cache.where:
                    continue
                if self._jobs.full():
                    break
                slot = self._take_slot(set(keys))
                if slot is None:
                    break
                self._assign(slot, key)
                slot.prefetched = slot.reading = True
                self._jobs.put_nowait((slot, key))
                cache.stats.prefetched += 1
                queued += 1
        return queued

    def advise(self, layer: int, expert_ids) -> int:
        """Ask the OS to start reading experts likely needed soon into its page cache.

        Unlike :meth:`prefetch` nothing becomes resident here: no slot is taken, nothing is
        evicted, the budget is untouched and no thread of this process reads; a later
        :meth:`load` of these experts finds their bytes in memory instead of on the disk
        (``MADV_WILLNEED`` on the mapping for ``io="mmap"``, ``posix_fadvise(WILLNEED)``
        for ``io="read"``; ``io="view"`` cannot). Resident experts are skipped. Under memory
        pressure the OS may drop the pages again before the load.

        Returns
        -------
        int
            How many experts were handed to the OS.
        """
        self._check_open()
        keys = self._keys(layer, expert_ids, "advise()")
        cache = self._cache
        with cache.lock:
            keys = [k for k in keys if k not in cache.where]
        advised = sum(self._io.advise(k) for k in keys)
        with cache.lock:
            cache.stats.advised += advised
        return advised

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued prefetch has been fetched (or has failed).

        Returns False if ``timeout`` seconds passed first. Useful before reading
        :attr:`stats` or checking residency: prefetches run in the background.
        """
        cache = self._cache
        deadline = None if timeout is None else time.monotonic() + timeout
        with cache.changed:
            while any(s.state == _LOADING and s.prefetched for s in cache.slots):
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    return False
                cache.changed.wait(left)
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the prefetch thread, give every page back, close every file.

        Idempotent and safe in any order: views still alive stay valid (they keep their
        memory: the pool, or the mapping, whose pages re-fault from the file when read);
        later loads raise ``ValueError``.
        """
        self._finalizer()

    def __enter__(self) -> Pager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Pager({self.source.files[0]!r}, budget_bytes={self.budget_bytes}, io={self.io!r}, "
            f"slots={self.capacity}x{self.slot_bytes}, policy={self.policy!r}"
            f"{', closed' if self.closed else ''})"
        )
