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
``load`` runs in phases: ``_claim`` (pin the hits, give each miss a slot), ``_fetch`` each
miss, ``_await`` (the hits other threads are fetching), ``_pin_views``; whatever interrupts
it (an error, ``KeyboardInterrupt``), ``_abandon`` fails the misses not yet read and drops
every pin the load still holds, so no slot is left loading or pinned for ever.

Waiting: a load that finds every slot pinned by other threads (their views, their loads,
queued prefetches) waits for them, up to ``wait_timeout`` seconds, as it does for an expert
another thread is reading; a load whose own thread pins the slots gets the
:class:`BudgetError` at once (waiting would never end).
"""

from __future__ import annotations

import contextlib
import errno
import functools
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
from colibri._validate import check_float, check_page_size_kb
from colibri.formats import ExpertWeights, WeightSource, open_weights
from colibri.pager._backends import (
    _IO,
    IO_BACKENDS,
    _MapIO,
    _ReadIO,
    _spans,
    _ViewIO,
    default_io,
)
from colibri.pager._cache import _EMPTY, _FAILED, _LOADING, _READY, PREFETCH, _Cache, _Slot
from colibri.pager._policies import CachePolicy, make_policy
from colibri.pager._policy_base import Key
from colibri.pager._replay import Trace
from colibri.pager._stats import LayerStats, PagerStats, _faults
from colibri.pager._views import ExpertBatch, _Pin, _Region

__all__ = ["BudgetError", "FileChangedError", "Pager"]


def _shutdown(cache: _Cache, backend: _IO, jobs: queue.Queue, workers: list) -> None:
    with cache.lock:
        cache.closed = True
        cache.changed.notify_all()  # loads waiting for a slot see the close, not wait_timeout
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
                pager._cache.unpin(slot, PREFETCH)
        else:
            # the prefetch's pin goes with the slot turning ready (or failing): drain() never
            # sees a ready slot still pinned; an error is stored on the slot for load()
            with contextlib.suppress(BaseException):
                pager._fetch(slot, key, release=PREFETCH)
        del pager


def _check_batch(pager_ref: weakref.ref, slots: list[_Slot]) -> None:
    """An ExpertBatch's release: its experts were read from their files, not from zeros."""
    pager = pager_ref()
    if pager is not None:
        pager._check_guards(slots, "ExpertBatch")


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
        ``"read"`` (default where the memory this process may use cannot hold the files:
        reads around the page cache there); see the module docstring.
    prefetch_queue : int
        Bound of the background prefetch queue (experts).
    record_trace : bool
        Record every load in :attr:`trace` (for :func:`colibri.pager.belady`).
    populate : bool
        ``io="read"`` only: commit the whole pool now (one write per OS page), so that first
        reads into a slot pay no zero-fill page faults. The process's RSS then starts at the
        pool size, which is still within the budget. Default: committed as slots are used.
    wait_timeout : float
        Seconds a load waits for slots other threads pin, or for an expert another thread
        is reading, before it raises (:class:`BudgetError`, ``TimeoutError``).

    Slots: ``budget_bytes // slot_bytes``, and never more than the experts the files hold (a
    larger budget, such as ``2**62`` for "no limit", is left unused; see
    ``stats.usable_bytes``).

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
        wait_timeout: float = 60.0,
    ) -> None:
        page_size_kb = check_page_size_kb(page_size_kb, "Pager(): ")
        self.wait_timeout = check_float("Pager(): wait_timeout", wait_timeout, positive=True)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
            raise TypeError(f"Pager(): budget_bytes must be an int (got {budget_bytes!r})")
        if prefetch_queue < 1:
            raise ValueError(f"Pager(): prefetch_queue must be >= 1 (got {prefetch_queue!r})")
        if io is not None and io not in IO_BACKENDS:
            raise ValueError(f"Pager(): io must be one of {IO_BACKENDS} (got {io!r})")
        self.source = open_weights(source)
        io = default_io(self.source.files) if io is None else io
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
        num_slots = min(self.budget_bytes // slot_bytes, len(self._spans))
        if num_slots < 1:
            largest = self.source.max_expert_nbytes
            raise BudgetError(
                f"Pager(): budget_bytes={self.budget_bytes} cannot hold one expert "
                f"({largest} bytes, touching {most} pages of {page_size_kb} KiB); "
                f"raise the budget to at least {slot_bytes}"
            )
        self._slot_bytes = slot_bytes
        stats = PagerStats(io=io, page_size=self.page_size, budget_bytes=self.budget_bytes,
                           usable_bytes=num_slots * slot_bytes,
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
        # A slot for every expert: nothing is ever evicted, so a step's policy bookkeeping
        # (the adaptive policy's shadow caches: ~20 us a load) would decide nothing.
        self._evicts = num_slots < len(self._spans)
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
                usable_bytes=old.usable_bytes, pool_bytes=old.pool_bytes,
                resident_bytes=old.resident_bytes,
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
        try:
            self._forget(slot)
        except BaseException:  # interrupted while giving pages back: the slot is not lost
            slot.state, slot.key = _EMPTY, None
            cache.free.append(slot.index)
            raise
        cache.stats.evictions += 1
        self._layer(victim[0]).evictions += 1
        slot.state, slot.key = _EMPTY, None
        return slot

    def _claimable(self, step: set[Key], need: int) -> bool:
        """Whether ``need`` slots can be taken now: free ones, or unpinned loaded experts
        outside ``step`` (lock held)."""
        cache = self._cache
        have = len(cache.free)
        if have >= need:
            return True
        for key, slot in cache.where.items():
            if slot.pins == 0 and slot.state == _READY and key not in step:
                have += 1
                if have >= need:
                    return True
        return False

    def _assign(self, slot: _Slot, key: Key, holder: int) -> None:
        """Put ``key`` in the free ``slot``, loading, pinned by ``holder`` (lock held)."""
        cache, stats = self._cache, self._cache.stats
        try:
            pages = self._io.claim(slot, key)  # first: nothing else has changed if it fails
        except BaseException:
            cache.free.append(slot.index)
            raise
        slot.key, slot.state, slot.pins, slot.error = key, _LOADING, 0, None
        slot.holders = {}
        cache.pin(slot, holder)  # the loader's pin
        slot.event = threading.Event()
        slot.nbytes = self.source.experts[key].nbytes
        slot.prefetched = slot.reading = False
        cache.where[key] = slot
        self._policy.insert(key)
        slot.pages = pages
        stats.pages_loaded += pages
        self._layer(key[0]).pages_loaded += pages
        stats.resident_bytes += slot.nbytes
        stats.resident_pages += pages
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)
        stats.peak_resident_pages = max(stats.peak_resident_pages, stats.resident_pages)

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

    def _fetch(self, slot: _Slot, key: Key, *, release: int | None = None) -> None:
        """Make ``key`` readable in ``slot`` (lock not held); mark it ready, or failed (its
        pins stay with their holders). With ``release``, that holder's pin is dropped in the
        same locked step (drain() never sees a ready slot still pinned by a prefetch)."""
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
            path = self._io.faulted(slot, key)  # making pages resident read past the end
            if path is not None:
                self._changed(path, "load()")
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
                if release is not None:
                    cache.unpin(slot, release)
        except BaseException as exc:
            with cache.lock:
                if slot.state == _LOADING:
                    self._fail(slot, exc)
                if release is not None and slot.holders.get(release):
                    cache.unpin(slot, release)
            raise

    def _fail(self, slot: _Slot, exc: BaseException, *, loaded: bool = False) -> None:
        """``slot``'s expert cannot be served (its fetch failed or was abandoned, or
        ``loaded`` and its file changed): forget it, give its pages back and wake waiters;
        the slot is recycled with its last pin (lock held)."""
        cache = self._cache
        if cache.where.get(slot.key) is slot:
            del cache.where[slot.key]
            self._policy.remove(slot.key)
            if not cache.closed:  # close() already took every page back
                self._forget(slot, failed=not loaded)
        if not isinstance(exc, Exception):  # KeyboardInterrupt: the reader's, not the waiters'
            exc = RuntimeError(
                f"load(): expert {slot.key} was not read: the load reading it was interrupted "
                f"({type(exc).__name__}); load it again"
            )
        slot.error, slot.state = exc, _FAILED
        slot.event.set()
        cache.changed.notify_all()

    def _changed(self, path: str, where: str) -> None:
        """Raise :class:`FileChangedError` for ``path``, whose mapping read past its end."""
        self._io.check([self.source.files.index(path)], where)  # says how it changed
        raise FileChangedError(
            f"{where}: weight file {path!r} must not change while a Pager uses it (it shrank "
            "while its mapping was read); open a new Pager on the file as it is now (io='read' "
            "tolerates files that may change)"
        )

    def _check_guards(self, slots: list[_Slot], where: str) -> None:
        """:class:`FileChangedError` if an expert of ``slots`` was read through a mapping that
        met the end of its file (zeros stand there now); those experts are forgotten, never
        served again. The slots are pinned by the caller."""
        if not self._io.any_faulted():  # a token's held experts: one check a file
            return
        bad = [(s, path) for s in slots if (path := self._io.faulted(s, s.key)) is not None]
        if not bad:
            return
        error = FileChangedError(f"{where}: weight file {bad[0][1]!r} shrank while it was read")
        with self._cache.lock:
            for slot, _ in bad:
                if slot.state == _READY:
                    self._fail(slot, error, loaded=True)
        self._changed(bad[0][1], where)

    def _views(self, slot: _Slot, pin: _Pin) -> ExpertWeights:
        """Views of a ready slot's matrices; they own ``pin``."""
        layout = self.source.experts[slot.key]
        owners = self._io.owners(slot, slot.key)
        regions: dict[int, np.ndarray] = {}
        buffers = []
        for ref, (owner, address, at) in zip(layout.matrices, owners):  # noqa: B905 (as many)
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
            More unique experts than slots; every slot pinned by this thread's live views;
            or pinned by other threads for more than ``wait_timeout`` seconds.
        TimeoutError
            Another thread has been reading one of these experts for ``wait_timeout``.
        FileChangedError
            A weight file of these experts was truncated, replaced or modified since open
            (also raised by the batch's release when it shrank while the views were read).
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
        me = threading.get_ident()
        pinned: list[_Slot] = []  # slots this load pins, until its views adopt the pins
        mine: list[_Slot] = []  # the misses this load fetches
        try:
            self._claim(layer, keys, me, pinned, mine)
            for slot in mine:
                self._fetch(slot, slot.key)
            self._await(pinned)
            slots = list(pinned)
            experts = self._pin_views(pinned, me)
        except BaseException as exc:
            self._abandon(pinned, mine, me, exc)
            raise
        check = None
        if self._io.name != "read":
            check = functools.partial(_check_batch, weakref.ref(self), slots)
        return ExpertBatch(layer, experts, check)

    def reuse(self, layer: int, expert_ids) -> None:
        """Count a step served again from views the caller holds, with no :meth:`load`.

        For a caller that keeps its batches across steps (a budget that holds every expert,
        so nothing needs their slots): the experts ``expert_ids`` of ``layer``, resident and
        pinned by live views, count as demand hits (:attr:`stats`, :meth:`usage`,
        :attr:`trace`), and their files are checked as :meth:`load` and a batch's release
        check them. Call it after computing on the views: an error means the step's result
        must not be used.

        Raises
        ------
        ValueError
            The pager is closed.
        KeyError
            An expert not resident, or not pinned by live views (load it).
        FileChangedError
            A weight file of these experts was truncated, replaced or modified since it was
            opened, or shrank while the views were read.
        """
        self.reuse_many([(layer, expert_ids)])

    def reuse_many(self, steps) -> None:
        """:meth:`reuse` for several steps at once, in order (a decoding token's layers):
        every step counted, their files checked once.

        Parameters
        ----------
        steps : iterable of (int, sequence of int)
            ``(layer, expert_ids)`` of each step.

        Raises
        ------
        ValueError, KeyError, FileChangedError
            As :meth:`reuse`; nothing is counted when an expert is not held.
        """
        steps = [(int(layer), sorted({int(e) for e in ids})) for layer, ids in steps]
        cache = self._cache
        with cache.lock:
            self._check_open()
            where = cache.where
            slots, keys = [], []
            for layer, ids in steps:
                for e in ids:
                    key = (layer, e)
                    slot = where.get(key)
                    if slot is None or not slot.pins or slot.state != _READY:
                        raise KeyError(
                            f"reuse(): expert {key} is not held by live views of this pager; "
                            "load() it and keep the batch"
                        )
                    slots.append(slot)
                    keys.append(key)
            stats, usage, trace = cache.stats, self._usage, self.trace
            for layer, ids in steps:
                if trace is not None:  # counted as load() counts: before the checks
                    trace.steps.append((layer, tuple(ids)))
                stats.hits += len(ids)
                self._layer(layer).hits += len(ids)
            for key in keys:
                usage[key] = usage.get(key, 0) + 1
                if self._evicts:
                    self._policy.touch(key)
        self._io.check(self._all_files if self._single_file else self._step_files(keys), "reuse()")
        self._check_guards(slots, "reuse()")

    # The phases of a load. `pinned` holds each slot this load has a pin on; a phase that
    # drops a pin or hands it to a view takes the slot out.

    def _claim(
        self, layer: int, keys: list[Key], me: int, pinned: list[_Slot], mine: list[_Slot]
    ) -> None:
        """Pin every expert of the step, under the lock: hits first, then a slot per miss
        (the policy's victim evicted) into ``mine``; all of them or, if the slots are short,
        none (then it waits for other threads' pins to go, up to ``wait_timeout``).

        Raises
        ------
        BudgetError
            Every slot is pinned by this thread, or by others for ``wait_timeout`` seconds.
        """
        cache = self._cache
        step = set(keys)
        deadline = None
        with cache.lock:
            while True:
                self._check_open()
                if self._claimable(step, sum(k not in cache.where for k in keys)):
                    break
                others = any(
                    s.holders and me not in s.holders and s.key not in step for s in cache.slots
                )
                if not others:  # this thread's own views hold them: waiting would never end
                    raise BudgetError(
                        f"load(): every one of the {self.capacity} slots is pinned by live "
                        "expert views of this thread; release ExpertBatch handles (or drop "
                        "kept views) or raise budget_bytes"
                    )
                if deadline is None:
                    deadline = time.monotonic() + self.wait_timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BudgetError(
                        f"load(): layer {layer} experts {[e for _, e in keys]} found every one "
                        f"of the {self.capacity} slots pinned by other threads for "
                        f"wait_timeout={self.wait_timeout} s; release their ExpertBatch "
                        "handles sooner, raise budget_bytes or wait_timeout"
                    )
                cache.changed.wait(left)
            if self.trace is not None:
                self.trace.steps.append((layer, tuple(e for _, e in keys)))
            stats, per = cache.stats, self._layer(layer)
            if self._evicts:
                self._policy.begin_step(layer, keys)
            missed = []
            for key in keys:
                self._usage[key] = self._usage.get(key, 0) + 1
                slot = cache.where.get(key)
                if slot is None:
                    missed.append(key)
                else:
                    self._hit(slot, stats, per, me)
                    pinned.append(slot)
            for key in missed:
                slot = self._take_slot(step)
                if slot is None:  # _claimable counted it: a policy that lost a key
                    raise BudgetError(f"load(): no slot for expert {key}; raise budget_bytes")
                self._assign(slot, key, me)
                pinned.append(slot)
                mine.append(slot)
                stats.misses += 1
                per.misses += 1
                slot.reading = True  # fetched right after the lock is released

    def _hit(self, slot: _Slot, stats: PagerStats, per: LayerStats, me: int) -> None:
        """Count a demand hit on ``slot`` and pin it (lock held)."""
        stats.hits += 1
        per.hits += 1
        self._policy.touch(slot.key)
        self._cache.pin(slot, me)
        if slot.prefetched:
            slot.prefetched = False
            stats.prefetch_hits += 1
        if slot.state != _READY:
            stats.inflight_waits += 1

    def _await(self, pinned: list[_Slot]) -> None:
        """Wait for the hits other threads are fetching, up to ``wait_timeout``; raise the
        error of one that failed."""
        deadline = time.monotonic() + self.wait_timeout
        for slot in pinned:
            if not slot.event.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    errno.ETIMEDOUT,
                    f"load(): expert {slot.key} was still being read by another thread after "
                    f"wait_timeout={self.wait_timeout} s (a stalled disk?); raise "
                    "wait_timeout or check the storage",
                )
            if slot.state != _READY:
                raise slot.error

    def _pin_views(self, pinned: list[_Slot], me: int) -> dict[int, ExpertWeights]:
        """The experts' views by id, ascending; each adopts this load's pin on its slot."""
        experts = {}
        while pinned:
            slot = pinned.pop()
            experts[slot.key[1]] = self._views(slot, _Pin(self._cache, slot, me))
        return dict(sorted(experts.items()))

    def _abandon(self, pinned: list[_Slot], mine: list[_Slot], me: int, exc: BaseException):
        """A load stopped early: fail its misses not yet read, drop the pins it holds."""
        cache = self._cache
        with cache.lock:
            for slot in mine:
                if slot.state == _LOADING and slot in pinned:
                    self._fail(slot, exc)
            while pinned:
                cache.unpin(pinned.pop(), me)

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
                self._assign(slot, key, PREFETCH)
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
