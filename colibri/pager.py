"""The Pager: expert weights read from files into a fixed pool, under a hard memory budget.

How it works
------------
The unit of caching is the expert: its ``gate``, ``up`` and ``down`` matrices together. At
construction the pager allocates one pool of ``num_slots x slot_bytes`` bytes, where
``slot_bytes`` is the largest expert rounded up to ``page_size_kb`` and ``num_slots`` is as many
slots as fit in ``budget_bytes``. An expert is read into a free slot with explicit positional
reads (``os.preadv`` on POSIX, ``seek`` + ``readinto`` on Windows; see
:mod:`colibri.formats._io`), never through a memory map. So the bookkeeping is one entry per
expert, however many 4 KiB pages the expert spans; pages only set the slot size and alignment.

"Resident" means: expert bytes held in the pool (slots whose expert is loaded or being
loaded). ``stats.resident_bytes`` is their exact sum and can never exceed ``pool_bytes <=
budget_bytes``: the pool is the only place the pager keeps expert bytes, it is allocated
zero-filled and lazily committed, and it never grows. The OS page cache that reads pass through
is kernel memory, reclaimable and not part of the process's RSS.

Views and pinning
-----------------
:meth:`Pager.load` returns an :class:`ExpertBatch` of read-only numpy views into the pool. A slot
is pinned (never evicted, never overwritten) while any view of it is alive, including views
derived from it (slices, ``torch.from_numpy``, DLPack exports): every view's memory is owned by
a small per-load lease object, and the slot is released when the last lease dies. Leaving the
``with`` block drops the batch's own references, so the slot is free again unless the caller
kept a view. Closing the pager never invalidates live views (they keep the pool alive).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from colibri._errors import ColibriError
from colibri.config import check_page_size_kb
from colibri.formats import WeightSource, open_weights
from colibri.formats._base import ExpertLayout
from colibri.formats._io import FileReader
from colibri.policies import CachePolicy, Trace, make_policy

__all__ = ["BudgetError", "ExpertBatch", "ExpertWeights", "LayerStats", "Pager", "PagerStats"]

Key = tuple[int, int]
_EMPTY, _LOADING, _READY, _FAILED = 0, 1, 2, 3


class BudgetError(ColibriError, MemoryError):
    """The budget cannot hold what a call needs (too small, or every slot pinned by views)."""


@dataclass
class LayerStats:
    """Counters of one layer."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class PagerStats(LayerStats):
    """Pager counters (a snapshot; see :attr:`Pager.stats`).

    ``hits``/``misses`` count demand accesses (one per unique expert per :meth:`Pager.load`);
    an expert found in flight from a prefetch counts as a hit and as an ``inflight_wait``.
    ``bytes_read`` includes prefetch reads. ``read_seconds`` is the wall time spent inside
    reads (summed over threads); ``read_throughput`` = ``bytes_read / read_seconds``.
    """

    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    pool_bytes: int = 0
    budget_bytes: int = 0
    read_seconds: float = 0.0
    prefetched: int = 0
    prefetch_hits: int = 0
    inflight_waits: int = 0
    per_layer: dict[int, LayerStats] = field(default_factory=dict)

    @property
    def read_throughput(self) -> float:
        """Bytes per second while reading."""
        return self.bytes_read / self.read_seconds if self.read_seconds else 0.0


class _Slot:
    __slots__ = (
        "error", "event", "index", "key", "nbytes", "pins", "prefetched", "reading", "state",
    )  # fmt: skip

    def __init__(self, index: int) -> None:
        self.index = index
        self.key: Key | None = None
        self.state = _EMPTY
        self.pins = 0
        self.nbytes = 0
        self.event: threading.Event | None = None
        self.error: BaseException | None = None
        self.prefetched = False
        self.reading = False  # a read was started or queued: the slot will leave _LOADING


class _Lease:
    """Owns the memory of one slot's views; the slot is pinned until every lease dies."""

    __slots__ = ("__array_interface__", "__weakref__", "_cache", "_pool", "_slot")

    def __init__(self, cache: _Cache, slot: _Slot, nbytes: int) -> None:
        self._cache = cache
        self._pool = cache.pool  # keeps the pool's memory alive after Pager.close()
        self._slot = slot
        address = cache.pool.ctypes.data + slot.index * cache.slot_bytes
        self.__array_interface__ = {
            "data": (address, True),  # read-only
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown nothing is left to free
            self._cache.unpin(self._slot)


class ExpertWeights:
    """One expert's matrices: ``gate [I, H]``, ``up [I, H]``, ``down [H, I]`` (read-only).

    ``y = down @ (act(gate @ x) * (up @ x))``. Quantized GGUF matrices are ``uint8 [rows,
    row_bytes]`` blocks; ``layout`` names their type.
    """

    __slots__ = ("down", "expert", "gate", "layer", "layout", "up")

    def __init__(self, layout: ExpertLayout, buffer: np.ndarray) -> None:
        self.layer, self.expert, self.layout = layout.layer, layout.expert, layout
        at = 0
        views = []
        for ref in layout.matrices:
            views.append(ref.view(buffer[at : at + ref.nbytes]))
            at += ref.nbytes
        self.gate, self.up, self.down = views

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def __repr__(self) -> str:
        return (
            f"ExpertWeights(layer={self.layer}, expert={self.expert}, gate={self.gate.shape}, "
            f"dtype={self.layout.gate.dtype})"
        )


class ExpertBatch(Mapping):
    """The experts of one :meth:`Pager.load`: ``batch[e]`` is an :class:`ExpertWeights`.

    Use as a context manager (or call :meth:`release`): afterwards the batch holds no views, so
    the pager may reuse the slots, except those of views the caller still keeps alive.
    """

    def __init__(self, layer: int, experts: dict[int, ExpertWeights]) -> None:
        self.layer = layer
        self._experts: dict[int, ExpertWeights] | None = experts

    def _live(self) -> dict[int, ExpertWeights]:
        if self._experts is None:
            raise RuntimeError("this ExpertBatch was released; load the experts again")
        return self._experts

    def __getitem__(self, expert: int) -> ExpertWeights:
        experts = self._live()
        try:
            return experts[int(expert)]
        except KeyError:
            raise KeyError(
                f"expert {expert} was not loaded in this batch (loaded: {sorted(experts)})"
            ) from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def release(self) -> None:
        """Drop this batch's views (idempotent)."""
        self._experts = None

    def __enter__(self) -> ExpertBatch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Cache:
    """All mutable pager state, shared with leases and the prefetch thread (not the Pager)."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # a slot was read, failed or unpinned
        self.slot_bytes = slot_bytes
        self.pool = np.zeros(num_slots * slot_bytes, dtype=np.uint8)  # calloc: lazily committed
        self.slots = [_Slot(i) for i in range(num_slots)]
        self.free = list(range(num_slots - 1, -1, -1))
        self.where: dict[Key, _Slot] = {}
        self.closed = False
        self.resident_bytes = 0
        self.peak_resident_bytes = 0

    def unpin(self, slot: _Slot) -> None:
        """Drop one pin; a failed slot goes back to the free list with its last pin."""
        with self.lock:
            slot.pins -= 1
            self.changed.notify_all()
            if slot.pins == 0 and slot.state == _FAILED:
                slot.state, slot.key = _EMPTY, None
                self.free.append(slot.index)


def _plan(layout: ExpertLayout) -> list[tuple[str, int, int, int]]:
    """Reads that fill a slot with gate|up|down: ``(path, file_offset, slot_offset, nbytes)``,
    adjacent ranges merged so a contiguous expert is one read."""
    plan: list[list] = []
    at = 0
    for ref in layout.matrices:
        last = plan[-1] if plan else None
        if last and last[0] == ref.path and last[1] + last[3] == ref.offset:
            last[3] += ref.nbytes
        else:
            plan.append([ref.path, ref.offset, at, ref.nbytes])
        at += ref.nbytes
    return [tuple(p) for p in plan]


def _shutdown(cache: _Cache, reader: FileReader, jobs: queue.Queue, workers: list) -> None:
    with cache.lock:
        cache.closed = True
    for worker in workers:
        if worker is threading.current_thread():  # the Pager died in its own worker
            with contextlib.suppress(queue.Full):  # else it sees the dead Pager at its next job
                jobs.put_nowait(None)
        elif worker.is_alive():
            jobs.put(None)  # the worker drains the queue, so this cannot block for ever
            worker.join()
    reader.close()


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
            try:
                pager._read(slot, key)
            except BaseException:  # stored on the slot; a waiting load() raises it
                pass
            else:
                pager._cache.unpin(slot)  # the loader's pin
        del pager


class Pager:
    """Expert weights from files, cached per expert in a pool of at most ``budget_bytes``.

    Parameters
    ----------
    source : path-like or WeightSource
        A weight file (safetensors, sharded index, GGUF, colibri raw) or an opened source.
    budget_bytes : int
        Hard limit on resident expert bytes; the pool never exceeds it.
    page_size_kb : int
        Unit of I/O alignment and of the budget (4, 32, 64, ... KiB; a power of two).
    policy : str or CachePolicy
        ``"fifo"`` (default, the seed's), ``"lru"``, ``"lfu"``, ``"lrfu"``, ``"nextuse"``,
        ``"hot"`` (see :mod:`colibri.policies`).
    policy_options : dict, optional
        Passed to the policy (``half_life`` for lrfu; ``counts``, ``hot_fraction`` for hot).
    prefetch_queue : int
        Bound of the background prefetch queue (experts).
    record_trace : bool
        Record every load in :attr:`trace` (for :func:`colibri.policies.belady`).
    populate : bool
        Commit the whole pool now (one write per OS page), so that first reads into a slot
        pay no zero-fill page faults. The process's RSS then starts at the pool size, which is
        still within the budget. Default: the pool is committed as slots are first used.

    Examples
    --------
    >>> pager = Pager("experts.colibri", budget_bytes=3 << 30)          # doctest: +SKIP
    >>> with pager.load(0, ids) as experts:                             # doctest: +SKIP
    ...     w = experts[ids[0, 0]]
    ...     y = w.down @ (silu(w.gate @ x) * (w.up @ x))
    """

    def __init__(
        self,
        source: str | os.PathLike | WeightSource,
        *,
        budget_bytes: int,
        page_size_kb: int = 64,
        policy: str | CachePolicy = "fifo",
        policy_options: dict | None = None,
        prefetch_queue: int = 64,
        record_trace: bool = False,
        populate: bool = False,
    ) -> None:
        page_size_kb = check_page_size_kb(page_size_kb, "Pager(): ")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
            raise TypeError(f"Pager(): budget_bytes must be an int (got {budget_bytes!r})")
        if prefetch_queue < 1:
            raise ValueError(f"Pager(): prefetch_queue must be >= 1 (got {prefetch_queue!r})")
        self.source = open_weights(source)
        self.page_size = page_size_kb * 1024
        self.budget_bytes = int(budget_bytes)
        largest = self.source.max_expert_nbytes
        slot_bytes = -(-largest // self.page_size) * self.page_size
        num_slots = self.budget_bytes // slot_bytes if slot_bytes else 0
        if num_slots < 1:
            raise BudgetError(
                f"Pager(): budget_bytes={self.budget_bytes} cannot hold one expert "
                f"({largest} bytes, {slot_bytes} rounded up to {page_size_kb} KiB pages); "
                f"raise the budget to at least {slot_bytes}"
            )
        self._cache = _Cache(num_slots, slot_bytes)
        if populate:
            self._cache.pool[::4096] = 0
        self._reader = FileReader(self.source.files)
        self._plans: dict[Key, list] = {}
        self._policy = make_policy(policy, num_slots, **(policy_options or {}))
        self._stats = PagerStats(budget_bytes=self.budget_bytes, pool_bytes=num_slots * slot_bytes)
        self._usage: dict[Key, int] = {}
        self.trace: Trace | None = Trace() if record_trace else None
        self._jobs: queue.Queue = queue.Queue(maxsize=prefetch_queue)
        self._workers: list[threading.Thread] = []
        self._finalizer = weakref.finalize(
            self, _shutdown, self._cache, self._reader, self._jobs, self._workers
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Number of expert slots in the pool."""
        return len(self._cache.slots)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot (largest expert rounded up to the page size)."""
        return self._cache.slot_bytes

    @property
    def policy(self) -> str:
        """Name of the current cache policy."""
        return self._policy.name

    @property
    def closed(self) -> bool:
        return self._cache.closed

    @property
    def stats(self) -> PagerStats:
        """A snapshot of the counters."""
        with self._cache.lock:
            s = self._stats
            snap = PagerStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})
            snap.per_layer = {k: LayerStats(**vars(v)) for k, v in s.per_layer.items()}
            snap.resident_bytes = self._cache.resident_bytes
            snap.peak_resident_bytes = self._cache.peak_resident_bytes
            return snap

    def reset_stats(self) -> None:
        """Zero the counters (peak resident bytes restarts from the current level)."""
        with self._cache.lock:
            self._stats = PagerStats(
                budget_bytes=self.budget_bytes, pool_bytes=self._stats.pool_bytes
            )
            self._cache.peak_resident_bytes = self._cache.resident_bytes

    def usage(self) -> dict[Key, int]:
        """Demand accesses per ``(layer, expert)`` since construction (for the ``hot`` policy)."""
        with self._cache.lock:
            return dict(self._usage)

    def resident(self) -> list[Key]:
        """Keys of the experts now in the pool (loaded or loading)."""
        with self._cache.lock:
            return sorted(self._cache.where)

    # -- policy -------------------------------------------------------------------------------

    def set_cache_policy(self, policy: str | CachePolicy, **options) -> None:
        """Switch the eviction policy now; resident experts stay, in the old eviction order.

        ``policy`` is one of ``fifo``, ``lru``, ``lfu``, ``lrfu``, ``nextuse``, ``hot`` or a
        :class:`~colibri.policies.CachePolicy`; ``options`` go to its constructor.
        """
        new = make_policy(policy, self.capacity, **options)
        with self._cache.lock:
            for key in self._policy.eviction_order():
                new.insert(key)
            self._policy = new

    # -- loading ------------------------------------------------------------------------------

    def _keys(self, layer: int, expert_ids) -> list[Key]:
        ids = np.asarray(expert_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"load(): expert ids must be integers (got dtype {ids.dtype})")
        unique = np.unique(ids.ravel())
        keys = [(int(layer), int(e)) for e in unique]
        for key in keys:
            self.source.layout(*key)  # KeyError naming the valid range
        if len(keys) > self.capacity:
            raise BudgetError(
                f"load(): {len(keys)} unique experts requested but the budget holds "
                f"{self.capacity} ({self.slot_bytes} bytes each); raise budget_bytes"
            )
        return keys

    def _check_open(self) -> None:
        if self._cache.closed:
            raise ValueError("this Pager is closed")

    def _take_slot(self, step: set[Key]) -> _Slot | None:
        """A free slot, or the policy's victim among unpinned loaded experts (lock held)."""
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
        cache.resident_bytes -= slot.nbytes
        self._stats.evictions += 1
        self._layer(victim[0]).evictions += 1
        slot.state, slot.key = _EMPTY, None
        return slot

    def _assign(self, slot: _Slot, key: Key) -> None:
        cache = self._cache
        slot.key, slot.state, slot.pins, slot.error = key, _LOADING, 1, None
        slot.event = threading.Event()
        slot.nbytes = self.source.experts[key].nbytes
        slot.prefetched = slot.reading = False
        cache.where[key] = slot
        cache.resident_bytes += slot.nbytes
        cache.peak_resident_bytes = max(cache.peak_resident_bytes, cache.resident_bytes)
        self._policy.insert(key)

    def _layer(self, layer: int) -> LayerStats:
        per = self._stats.per_layer.get(layer)
        if per is None:
            per = self._stats.per_layer[layer] = LayerStats()
        return per

    def _read(self, slot: _Slot, key: Key) -> None:
        """Read ``key`` into ``slot`` (lock not held); mark it ready or failed."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan(self.source.experts[key])
        cache = self._cache
        base = memoryview(cache.pool)[slot.index * cache.slot_bytes :]
        start = time.perf_counter()
        try:
            for path, offset, at, nbytes in plan:
                self._reader.readinto(path, offset, base[at : at + nbytes])
        except BaseException as exc:
            with cache.lock:
                self._fail(slot, exc)
            raise
        finally:
            base.release()
        elapsed = time.perf_counter() - start
        with cache.lock:
            slot.state = _READY
            self._stats.bytes_read += slot.nbytes
            self._stats.read_seconds += elapsed
            self._layer(key[0]).bytes_read += slot.nbytes
            slot.event.set()
            cache.changed.notify_all()

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        """A read into ``slot`` failed or was abandoned: forget the expert, wake waiters and
        drop the loader's pin; the slot is recycled with its last pin (lock held)."""
        cache = self._cache
        if cache.where.get(slot.key) is slot:
            del cache.where[slot.key]
            self._policy.remove(slot.key)
            cache.resident_bytes -= slot.nbytes
        slot.error, slot.state = exc, _FAILED
        slot.event.set()
        cache.unpin(slot)

    def load(self, layer: int, expert_ids) -> ExpertBatch:
        """Make the experts of one routing step resident and return views of their weights.

        Parameters
        ----------
        layer : int
            Layer index.
        expert_ids : array-like of int
            Any shape, e.g. ``ids [T, k]`` from ``ctx.route``; each unique expert is read at
            most once (the batch union), hits first, then misses in ascending id order.

        Returns
        -------
        ExpertBatch
            ``batch[e].gate``, ``.up``, ``.down``: read-only numpy arrays pinned while alive.

        Raises
        ------
        KeyError
            An expert that the file does not hold.
        BudgetError
            More unique experts than slots, or every slot pinned by live views.
        """
        self._check_open()
        keys = self._keys(layer, expert_ids)
        cache = self._cache
        step = set(keys)
        ready: list[_Slot] = []
        wait: list[_Slot] = []
        mine: list[_Slot] = []
        with cache.lock:
            self._check_open()
            if self.trace is not None:
                self.trace.steps.append((int(layer), tuple(e for _, e in keys)))
            stats, per = self._stats, self._layer(int(layer))
            handled: set[Key] = set()

            def hit(key: Key, slot: _Slot) -> None:
                handled.add(key)
                stats.hits += 1
                per.hits += 1
                self._policy.touch(key)
                slot.pins += 1
                if slot.prefetched:
                    slot.prefetched = False
                    stats.prefetch_hits += 1
                if slot.state == _READY:
                    ready.append(slot)
                else:
                    stats.inflight_waits += 1
                    wait.append(slot)

            self._policy.begin_step(int(layer), keys)
            for key in keys:
                self._usage[key] = self._usage.get(key, 0) + 1
                slot = cache.where.get(key)
                if slot is not None:
                    hit(key, slot)
            for key in keys:
                while key not in handled:
                    slot = cache.where.get(key)
                    if slot is not None:  # another thread loaded it while we waited
                        hit(key, slot)
                        break
                    slot = self._take_slot(step)
                    if slot is not None:
                        self._assign(slot, key)
                        stats.misses += 1
                        per.misses += 1
                        mine.append(slot)
                        handled.add(key)
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
            for x in mine:  # read right after the lock is released
                x.reading = True
        done: list[_Slot] = list(ready)
        error: BaseException | None = None
        for slot in mine:
            if error is None:
                try:
                    self._read(slot, slot.key)
                    done.append(slot)
                except BaseException as exc:  # _read already failed the slot
                    error = exc
            else:
                with cache.lock:
                    self._fail(slot, error)
        for slot in wait:
            slot.event.wait()
            if slot.error is None:
                done.append(slot)
            else:
                error = error or slot.error
                cache.unpin(slot)
        if error is not None:
            for slot in done:
                cache.unpin(slot)
            raise error
        experts = {}
        for slot in done:
            layout = self.source.experts[slot.key]
            lease = _Lease(cache, slot, layout.nbytes)  # adopts this call's pin
            experts[slot.key[1]] = ExpertWeights(layout, np.asarray(lease))
        return ExpertBatch(int(layer), dict(sorted(experts.items())))

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, layer: int, expert_ids) -> int:
        """Announce experts likely needed soon; a background thread reads them.

        Experts already resident or in flight are skipped; a later :meth:`load` of an expert
        in flight waits for that read instead of reading again. Never blocks: when the bounded
        queue is full, or no slot is evictable, the rest of the request is dropped.

        Returns
        -------
        int
            How many reads were queued.
        """
        self._check_open()
        ids = np.asarray(expert_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"prefetch(): expert ids must be integers (got dtype {ids.dtype})")
        keys = [(int(layer), int(e)) for e in np.unique(ids.ravel())]
        for key in keys:
            self.source.layout(*key)
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
                self._stats.prefetched += 1
                queued += 1
        return queued

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued prefetch has been read (or has failed).

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
        """Stop the prefetch thread, wait for reads in flight, close every file.

        Idempotent and safe in any order: views still alive stay valid (they own the pool's
        memory); later loads raise ``ValueError``.
        """
        self._finalizer()

    def __enter__(self) -> Pager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Pager({self.source.files[0]!r}, budget_bytes={self.budget_bytes}, "
            f"slots={self.capacity}x{self.slot_bytes}, policy={self.policy!r}"
            f"{', closed' if self.closed else ''})"
        )
