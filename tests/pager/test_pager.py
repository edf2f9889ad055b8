"""The Pager: budget, pinning, policies against replay and Belady, prefetch, lifecycle; every
test that touches I/O runs on every backend (``io``)."""

import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import colibri
from _support.paging import held_pages, hook_io
from colibri._files import DIRECT_ALIGN, HAS_DIRECT, FileReader
from colibri._units import process_memory
from colibri.formats import open_weights
from colibri.formats.raw import write_experts
from colibri.pager import (
    DEFAULT_IO,
    IO_BACKENDS,
    POLICIES,
    BudgetError,
    FileChangedError,
    HotSetPolicy,
    Pager,
    Trace,
    _backends,
    belady,
    replay,
)

L, E, I, H = 3, 8, 16, 32  # one expert: 3 * 16 * 32 * 2 = 3072 bytes -> one 4 KiB slot
SLOT = 4096
BACKENDS = [b for b in IO_BACKENDS if b != "mmap" or DEFAULT_IO == "mmap"]  # mmap needs madvise


@pytest.fixture(params=[*BACKENDS, *(["direct"] if HAS_DIRECT else [])])
def io(request, monkeypatch):
    """A backend; ``direct``: ``"read"`` where memory cannot hold the files (O_DIRECT)."""
    if request.param == "direct":
        monkeypatch.setattr(_backends, "_cache_short", lambda nbytes: True)
        return "read"
    return request.param


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    rng = np.random.default_rng(0)
    experts = {
        (lay, e): (
            rng.standard_normal((I, H)).astype(np.float16),
            rng.standard_normal((I, H)).astype(np.float16),
            rng.standard_normal((H, I)).astype(np.float16),
        )
        for lay in range(L)
        for e in range(E)
    }
    path = write_experts(tmp_path_factory.mktemp("w") / "experts.colibri", experts)
    return path, experts


def check(batch, experts, layer):
    for e, w in batch.items():
        ref = experts[(layer, e)]
        np.testing.assert_array_equal(w.gate, ref[0])
        np.testing.assert_array_equal(w.up, ref[1])
        np.testing.assert_array_equal(w.down, ref[2])
        assert not w.gate.flags.writeable


def random_trace(steps, k=3, seed=0):
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1)
    popularity /= popularity.sum()
    return Trace(
        (s % L, rng.choice(E, size=(2, k), p=popularity)) for s in range(steps)
    )  # [T=2, k] ids per step, as ctx.route returns them


def test_exported():
    assert colibri.Pager is Pager and colibri.FileChangedError is FileChangedError
    assert issubclass(FileChangedError, OSError)


def test_load_returns_the_weights_and_reads_each_expert_once(io, weights):
    path, experts = weights
    with Pager(path, budget_bytes=8 * SLOT, page_size_kb=4, io=io) as pager:
        ids = np.array([[3, 1], [1, 3], [5, 3]])
        with pager.load(1, ids) as batch:
            assert sorted(batch) == [1, 3, 5]
            check(batch, experts, 1)
        s = pager.stats
        assert (s.misses, s.hits, s.bytes_read) == (3, 0, 3 * 3072)
        with pager.load(1, [5, 6]) as batch:
            check(batch, experts, 1)
        s = pager.stats
        assert (s.misses, s.hits, s.bytes_read) == (4, 1, 4 * 3072)
        assert s.per_layer[1].hits == 1 and s.read_throughput > 0


def test_budget_is_hard(io, weights):
    path, experts = weights
    with Pager(path, budget_bytes=6 * SLOT + 100, page_size_kb=4, io=io, policy="lru") as pager:
        assert pager.capacity == 6 and pager.io == io
        assert pager.stats.pool_bytes == (6 * SLOT if io == "read" else 0)
        for layer, ids in random_trace(200):
            with pager.load(layer, ids) as batch:
                check(batch, experts, layer)
            s = pager.stats
            assert s.resident_pages * s.page_size <= pager.budget_bytes
            assert s.resident_pages == held_pages(pager.source, pager.resident(), SLOT, io)
            assert s.pages_loaded - s.pages_evicted == s.resident_pages
        assert s.peak_resident_bytes == 6 * 3072 and s.peak_resident_pages == 6
        assert s.evictions > 0
        with pytest.raises(BudgetError, match="7 unique experts"):
            pager.load(0, range(7))
    with pytest.raises(BudgetError, match="cannot hold one expert"):
        Pager(path, budget_bytes=SLOT - 1, page_size_kb=4, io=io)
    with pytest.raises(ValueError, match="power of two"):
        Pager(path, budget_bytes=SLOT, page_size_kb=6)


def test_page_size_sets_slot_size(weights):
    path, _ = weights
    with Pager(path, budget_bytes=1 << 20, page_size_kb=64) as pager:
        assert pager.slot_bytes == 65536 and pager.capacity == 16


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"hot"}))
def test_pager_hits_equal_offline_replay(io, weights, policy):
    path, _ = weights
    trace = random_trace(300, seed=3)
    with Pager(path, budget_bytes=7 * SLOT, page_size_kb=4, io=io, policy=policy) as pager:
        for layer, ids in trace:
            pager.load(layer, ids).release()
        s = pager.stats
    expected = replay(trace, 7, policy)
    assert (s.hits, s.misses, s.evictions) == (expected.hits, expected.misses, expected.evictions)
    assert expected.hits <= belady(trace, 7).hits


def test_hot_policy_from_saved_usage(weights):
    path, _ = weights
    trace = random_trace(300, seed=4)
    with Pager(path, budget_bytes=7 * SLOT, page_size_kb=4, record_trace=True) as pager:
        for layer, ids in trace:
            pager.load(layer, ids).release()
        usage = pager.usage()
        assert usage == trace.counts() and pager.trace.steps == trace.steps
        hot = HotSetPolicy(7, counts=usage, hot_fraction=0.5)
        pager.set_cache_policy(hot)
        assert pager.policy == "hot"
        pager.reset_stats()
        for layer, ids in trace:
            pager.load(layer, ids).release()
        assert len(hot.hot) == 3 and all(k in pager.resident() for k in hot.hot)
    options = dict(counts=usage, hot_fraction=0.5)
    with Pager(path, budget_bytes=7 * SLOT, page_size_kb=4, policy="hot",
               policy_options=options) as pager:  # fmt: skip
        for layer, ids in trace:
            pager.load(layer, ids).release()
        s = pager.stats
    expected = replay(trace, 7, "hot", **options)
    assert (s.hits, s.misses, s.evictions) == (expected.hits, expected.misses, expected.evictions)
    assert expected.hits != replay(trace, 7, "lru").hits  # the hot set changed what hit
    with pytest.raises(ValueError, match="needs usage counts"):
        replay(trace, 7, "hot")
    with pytest.raises(ValueError, match="unknown cache policy 'nope'; available"):
        Pager(path, budget_bytes=7 * SLOT, page_size_kb=4).set_cache_policy("nope")


def evicted_by(pager, layer, ids):
    """Load ``ids`` of ``layer`` and return the keys that left the cache for them."""
    before = set(pager.resident())
    pager.load(layer, ids).release()
    return sorted(before - set(pager.resident()))


@pytest.mark.parametrize(
    ("old", "new", "order"),
    [("lru", "fifo", [1, 0, 2, 3]), ("fifo", "lru", [3, 1, 0, 2])],
)
def test_set_cache_policy_keeps_the_eviction_order(weights, old, new, order):
    # 3, 1, 0, 2 in, then 3 again: LRU's order is 1, 0, 2, 3, FIFO's 3, 1, 0, 2. The new
    # policy takes the residents in the old order, and misses alone (no hit reorders them
    # under either) evict in that order
    path, _ = weights
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, policy=old) as pager:
        for e in [3, 1, 0, 2, 3]:
            pager.load(0, [e]).release()
        pager.set_cache_policy(new)
        assert pager.policy == new and pager.resident() == [(0, e) for e in range(4)]
        assert [evicted_by(pager, 0, [e]) for e in (4, 5, 6, 7)] == [[(0, e)] for e in order]


def test_views_kept_alive_stay_pinned_and_correct(io, weights):
    path, experts = weights
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io, policy="fifo") as pager:
        with pager.load(0, [2]) as batch:
            kept = batch[2].gate[1:]  # derived view outlives the batch
            derived = kept.T
        with pytest.raises(RuntimeError, match="released"):
            batch[2]
        for layer, ids in random_trace(100, k=1):
            with pager.load(layer, ids) as b:
                check(b, experts, layer)
            np.testing.assert_array_equal(derived.T, experts[(0, 2)][0][1:])
        assert (0, 2) in pager.resident()
        with pytest.raises(BudgetError, match="pinned"):  # 3 free slots, 4 experts
            pager.load(1, [0, 1, 3, 4])
        del kept, derived
        gc.collect()
        pager.load(1, [0, 1, 3, 4]).release()
        assert (0, 2) not in pager.resident()


def test_torch_dlpack_is_zero_copy(io, weights):
    torch = pytest.importorskip("torch")
    path, experts = weights
    with (
        Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager,
        pager.load(2, [7]) as b,
    ):
        t = torch.from_dlpack(b[7].down)
        assert t.data_ptr() == b[7].down.ctypes.data
        np.testing.assert_array_equal(t.numpy(), experts[(2, 7)][2])


def test_bad_ids(io, weights):
    path, _ = weights
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager:
        with pytest.raises(KeyError, match="has 8 experts"):
            pager.load(0, [8])
        with pytest.raises(KeyError, match="layer 5 holds no experts"):
            pager.load(5, [0])
        with pytest.raises(TypeError, match="integers"):
            pager.load(0, [0.5])


def open_fds():
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None


def test_close_in_any_order_with_views_alive(io, weights):
    path, experts = weights
    before = open_fds()
    pager = Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io)
    batch = pager.load(0, [1, 2])
    view = batch[1].up
    pager.prefetch(1, [3, 4])
    pager.close()
    pager.close()
    np.testing.assert_array_equal(view, experts[(0, 1)][1])  # still valid after close
    batch.release()
    with pytest.raises(ValueError, match="closed"):
        pager.load(0, [1])
    with pytest.raises(ValueError, match="closed"):
        pager.prefetch(0, [1])
    del view, batch
    gc.collect()
    # A pager dropped without close() releases its files too, prefetch thread included.
    pager = Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io)
    pager.prefetch(0, [1])
    keep = pager.load(0, [2])[2].gate
    del pager
    gc.collect()
    np.testing.assert_array_equal(keep, experts[(0, 2)][0])
    del keep  # a live view of a mapping keeps the mapping's descriptor
    gc.collect()
    if before is not None:
        # the dropped pager's prefetch thread may still be finishing its last job (a mapping
        # it then closes): wait for it, boundedly, rather than race it
        for _ in range(100):
            if open_fds() == before:
                break
            time.sleep(0.02)
            gc.collect()
        assert open_fds() == before
    assert not [t for t in threading.enumerate() if t.name == "colibri-prefetch" and t.is_alive()]


def gate_fetches(monkeypatch, gate):
    """Hold every fetch (read or madvise) until ``gate`` opens; returns the fetches begun."""
    begun = []

    def before(kind, path, offset, length):
        if kind in ("read", "populate"):
            begun.append(offset)
            assert gate.wait(10), "the test never opened the gate"

    hook_io(monkeypatch, before)
    return begun


def open_when(gate, condition):
    """Open ``gate`` once ``condition()`` holds (polled; no timing assumption)."""

    def poll():
        for _ in range(10000):
            if condition():
                break
            threading.Event().wait(0.001)
        gate.set()

    threading.Thread(target=poll, daemon=True).start()


def test_prefetch_in_flight_is_waited_for_not_read_twice(io, weights, monkeypatch):
    path, experts = weights
    gate = threading.Event()
    begun = gate_fetches(monkeypatch, gate)
    with Pager(path, budget_bytes=8 * SLOT, page_size_kb=4, io=io) as pager:
        assert pager.prefetch(2, [4, 5]) == 2
        assert pager.prefetch(2, [4]) == 0  # already in flight
        open_when(gate, lambda: pager.stats.inflight_waits == 2)
        with pager.load(2, [4, 5, 6]) as batch:
            check(batch, experts, 2)
        s = pager.stats
        assert len(begun) == 3 and s.bytes_read == 3 * 3072
        assert (s.prefetched, s.prefetch_hits, s.inflight_waits, s.misses) == (2, 2, 2, 1)


def test_a_failed_fetch_fails_the_load_waiting_for_it(io, weights, monkeypatch):
    # a load finds expert 1 in flight (a prefetch) and waits; the prefetch fails: the load
    # raises its error and keeps no pin, the slot is free again, and the pager stays usable
    path, experts = weights
    gate, broken = threading.Event(), [True]

    def disk(kind, p, offset, length):
        if kind in ("read", "populate") and broken[0]:
            assert gate.wait(10), "the test never opened the gate"
            raise OSError(errno.EIO, "Input/output error")

    hook_io(monkeypatch, disk)
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager:
        assert pager.prefetch(0, [1]) == 1
        open_when(gate, lambda: pager.stats.inflight_waits == 1)
        with pytest.raises(OSError, match="Input/output error"):
            pager.load(0, [1])
        s = pager.stats
        assert (s.hits, s.prefetch_hits, s.inflight_waits, s.bytes_read) == (1, 1, 1, 0)
        assert not pager.pinned() and not pager.resident() and s.resident_pages == 0
        broken[0] = False
        with pager.load(0, [0, 1, 2, 3]) as batch:  # every slot is free
            check(batch, experts, 0)


def test_prefetch_queue_is_bounded(io, weights, monkeypatch):
    path, _ = weights
    gate = threading.Event()
    begun = gate_fetches(monkeypatch, gate)
    with Pager(path, budget_bytes=16 * SLOT, page_size_kb=4, io=io, prefetch_queue=2) as pager:
        assert pager.prefetch(0, [0]) == 1
        for _ in range(10000):  # until the worker holds that job, blocked at the gate
            if begun:
                break
            threading.Event().wait(0.001)
        assert pager.prefetch(0, range(1, 8)) == 2  # the queue holds 2
        gate.set()
        assert pager.drain(timeout=30) and pager.stats.prefetched == 3


def test_truncated_file_names_the_file_and_pager_recovers(io, tmp_path, weights):
    if sys.platform == "win32" and io != "read":
        pytest.skip("Windows refuses to truncate a file while it is mapped")
    _, experts = weights
    path = write_experts(tmp_path / "t.colibri", experts)
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager:
        with pager.load(0, [0, 1]) as batch:
            check(batch, experts, 0)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 4096)  # the last expert loses its bytes after validation
        with pytest.raises(FileChangedError, match=r"t\.colibri' must not change.*size changed"):
            pager.load(2, [7])
        with pytest.raises(FileChangedError, match="t.colibri"):
            pager.load(0, [0])  # a hit too: its pages may be gone with the truncation
        assert pager.resident() == [(0, 0), (0, 1)] and not pager.pinned()
        s = pager.stats
        assert s.resident_pages == 2 and s.pages_loaded - s.pages_evicted == 2
        with open(path, "r+b") as f:
            f.truncate(size)
        with pytest.raises(FileChangedError, match="modified|size"):  # same size, new mtime
            pager.load(0, [0])
    path = write_experts(tmp_path / "t.colibri", experts, overwrite=True)  # whole again
    source = open_weights(path)  # validated at its full size
    with open(source.files[0], "r+b") as f:  # the data of an overwrite: t.colibri.alt
        f.truncate(size - 4096)
    with pytest.raises(FileChangedError, match="must hold"):  # shorter than its header says
        Pager(source, budget_bytes=4 * SLOT, page_size_kb=4, io=io)


@pytest.mark.skipif(sys.platform == "win32", reason="Windows refuses to replace an open file")
def test_replaced_file_is_refused(io, tmp_path, weights):
    _, experts = weights
    path = write_experts(tmp_path / "r.colibri", experts)
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager:
        pager.load(1, [1]).release()
        other = write_experts(tmp_path / "other.colibri", experts)
        os.replace(other, path)  # same bytes, another file
        with pytest.raises(FileChangedError, match="r.colibri' must not change.*replaced"):
            pager.load(1, [2])
        os.unlink(path)
        with pytest.raises(FileChangedError, match="deleted"):
            pager.load(1, [1])


def test_drain_waits_for_queued_prefetches(io, weights):
    path, _ = weights
    with Pager(path, budget_bytes=12 * SLOT, page_size_kb=4, io=io) as pager:
        queued = pager.prefetch(0, list(range(8)))
        assert queued > 0 and pager.drain(timeout=30)
        assert not pager.pinned()
        assert pager.stats.prefetched == queued and len(pager.resident()) == queued


def test_drain_returns_with_the_prefetches_pins_given_back(io, weights, monkeypatch):
    """A prefetched slot turns ready and loses the prefetch's pin in one step: however late
    the prefetch thread runs after reading, drain() never returns between the two."""
    from colibri.pager._cache import _Cache

    unpin = _Cache.unpin

    def late_unpin(self, *args):  # the prefetch thread descheduled right after its read
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        unpin(self, *args)

    monkeypatch.setattr(_Cache, "unpin", late_unpin)
    path, _ = weights
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager:
        assert pager.prefetch(0, [1, 2]) == 2
        assert pager.drain(timeout=30)
        assert pager.pinned() == [] and pager.resident() == [(0, 1), (0, 2)]


def test_drain_returns_false_when_the_timeout_passes_first(io, weights, monkeypatch):
    path, _ = weights
    gate = threading.Event()
    gate_fetches(monkeypatch, gate)  # the prefetch stays in flight until the gate opens
    with Pager(path, budget_bytes=4 * SLOT, page_size_kb=4, io=io) as pager:
        assert pager.prefetch(0, [1]) == 1
        start = time.monotonic()
        assert pager.drain(timeout=0.2) is False
        assert time.monotonic() - start >= 0.2  # it waited the whole timeout
        assert pager.pinned() == [(0, 1)]  # still in flight
        gate.set()
        assert pager.drain(timeout=30) is True
        assert not pager.pinned() and pager.resident() == [(0, 1)]


def serve(pager, trace, experts):
    """Load every step of ``trace``, checking the bytes; the counters at the end."""
    budget = pager.budget_bytes
    for layer, ids in trace:
        with pager.load(layer, ids) as batch:
            check(batch, experts, layer)
        s = pager.stats
        assert s.resident_pages * s.page_size <= budget and s.pool_bytes <= budget
    return s.hits, s.misses, s.evictions, s.bytes_read


def test_populated_read_pool_serves_the_same_hits_within_the_budget(weights):
    path, experts = weights
    trace = random_trace(120, seed=6)
    got = {}
    for populate in (False, True):
        with Pager(path, budget_bytes=6 * SLOT + 100, page_size_kb=4, io="read",
                   policy="lru", populate=populate) as pager:  # fmt: skip
            assert pager.stats.pool_bytes == 6 * SLOT
            got[populate] = serve(pager, trace, experts)
    assert got[True] == got[False] and got[True][2] > 0


def resident_fraction(array: np.ndarray) -> float:
    """The share of ``array``'s whole pages present in memory (``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    first = -(-array.ctypes.data // page) * page
    count = (array.ctypes.data + array.nbytes - first) // page
    vec = (ctypes.c_ubyte * count)()
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(count * page), vec) == 0
    return sum(v & 1 for v in vec) / count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon and mincore")
def test_populate_commits_the_read_pool_at_once(tmp_path):
    # 1024 experts of 768 bytes, 64 to a page: a slot of one page or two (an expert across
    # a page boundary), and as many slots as the 64 MiB budget holds
    tiny = np.zeros((4, 32), np.float16)
    path = write_experts(tmp_path / "tiny.colibri", {(0, e): (tiny, tiny, tiny.T) for e in
                                                    range(1024)}, alignment=256)  # fmt: skip
    budget = 64 << 20
    gc.collect()
    before = process_memory().anon
    pager = Pager(path, budget_bytes=budget, page_size_kb=64, io="read")
    # without populate the pool is committed as slots are used (calloc)
    assert process_memory().anon - before < budget // 4
    assert pager.stats.pool_bytes == pager.stats.usable_bytes == budget
    pager.close()
    # with it at once, and its pages hold a byte each: the kernel cannot drop them as zeros
    pager = Pager(path, budget_bytes=budget, page_size_kb=64, io="read", populate=True)
    assert resident_fraction(pager._io.pool) >= 0.9
    assert pager.stats.pool_bytes == budget
    pager.close()


def test_threads_share_one_pager(io, weights):
    path, experts = weights
    errors = []
    with Pager(path, budget_bytes=12 * SLOT, page_size_kb=4, io=io, policy="lru") as pager:

        def work(seed):
            try:
                for layer, ids in random_trace(150, k=1, seed=seed):
                    if seed % 2:
                        pager.prefetch((layer + 1) % L, ids)
                    with pager.load(layer, ids) as batch:
                        check(batch, experts, layer)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pager.drain(timeout=30)  # prefetches still queued hold their slot's pin
        s = pager.stats
        assert not errors
        assert s.hits + s.misses == sum(
            len(ids) for t in range(4) for _, ids in random_trace(150, 1, t)
        )
        assert s.resident_pages * s.page_size <= pager.budget_bytes and not pager.pinned()
        assert s.resident_pages == held_pages(pager.source, pager.resident(), SLOT, io)


MEMORY_SCRIPT = textwrap.dedent(
    """
    import os, sys, numpy as np
    from colibri.formats.raw import write_experts
    from colibri.pager import Pager

    def peak_rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

    path, budget = sys.argv[1], int(sys.argv[2])
    pager = Pager(path, budget_bytes=budget, page_size_kb=64, policy="lru", io="read")
    before = peak_rss()
    total = 0
    for layer in range(8):
        for e in range(16):
            with pager.load(layer, [e, (e + 5) % 16]) as b:
                total += int(b[e].gate[0, 0] != 0)
    s = pager.stats
    assert s.bytes_read > 8 * budget, s
    print(before, peak_rss(), s.peak_resident_bytes)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc VmHWM")
def test_streaming_8x_the_budget_keeps_peak_rss_bounded(tmp_path):
    """The read backend's pool (the mapped backends: tests/test_pager_mmap.py)."""
    # 8 layers x 16 experts x 512 KiB = 64 MiB of experts; budget 8 MiB.
    rows = 512
    expert = (np.ones((rows, 256), np.float16),) * 2 + (np.ones((256, rows), np.float16),)
    writer_experts = (((lay, e), expert) for lay in range(8) for e in range(16))
    path = write_experts(tmp_path / "big.colibri", writer_experts, alignment=65536)
    budget = 8 << 20
    assert os.path.getsize(path) >= 8 * budget
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, path, str(budget)],
        capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path,
    )  # fmt: skip
    before, after, resident = map(int, out.stdout.split())
    assert resident <= budget
    assert after - before <= budget + (4 << 20), (before, after)


def test_property_pager_matches_replay_and_never_beats_belady(weights):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    path, experts = weights

    @hypothesis.settings(max_examples=25, deadline=None)
    @hypothesis.given(
        steps=st.lists(
            st.tuples(
                st.integers(0, L - 1), st.lists(st.integers(0, E - 1), min_size=1, max_size=3)
            ),
            min_size=1,
            max_size=40,
        ),
        capacity=st.integers(3, 8),
        policy=st.sampled_from(sorted(set(POLICIES) - {"hot"})),
        io=st.sampled_from(BACKENDS),
    )
    def pager_matches_replay(steps, capacity, policy, io):
        trace = Trace(steps)
        budget = capacity * SLOT
        with Pager(path, budget_bytes=budget, page_size_kb=4, policy=policy, io=io) as pager:
            for layer, ids in trace:
                with pager.load(layer, ids) as batch:
                    check(batch, experts, layer)
                assert pager.stats.resident_bytes <= budget
            hits = pager.stats.hits
        assert hits == replay(trace, capacity, policy).hits <= belady(trace, capacity).hits

    pager_matches_replay()


@pytest.mark.skipif(sys.platform == "win32", reason="resource.setrlimit")
@pytest.mark.parametrize("io_name", colibri.pager.IO_BACKENDS)
def test_a_budget_without_limit_is_capped_at_the_experts_in_the_files(weights, io_name):
    """``budget_bytes=2**62`` ("no limit") takes one slot per expert the files hold, not one
    per possible expert (a run-away list, or pool, of 2**62 // slot_bytes); the child runs
    under a 2 GiB address-space limit so that a regression fails instead of exhausting RAM."""
    path, experts = weights
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from colibri.pager import Pager
        with Pager({str(path)!r}, budget_bytes=2**62, page_size_kb=4, io={io_name!r}) as p:
            with p.load(0, [0, 1]) as batch:
                assert batch[1].gate.shape == batch[0].gate.shape
            s = p.stats
            print(p.capacity, p.slot_bytes, s.usable_bytes, s.budget_bytes)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    capacity, slot, usable, budget = map(int, done.stdout.split())
    assert capacity == len(experts)
    assert usable == capacity * slot and budget == 2**62


def _before_reads(monkeypatch, before):
    """Call ``before(direct, offset, view)`` ahead of every positional read (it may raise)."""
    real = FileReader._pread

    def pread(self, path, view, offset, direct=False):
        before(direct, offset, view)
        return real(self, path, view, offset, direct)

    monkeypatch.setattr(FileReader, "_pread", pread)


@pytest.fixture
def large(tmp_path):
    """Experts of 96768 bytes at offsets 4 KiB blocks do not divide
    (raw files align each matrix to 64 bytes here)."""
    rng = np.random.default_rng(3)
    experts = {
        (0, e): tuple(rng.standard_normal(s).astype(np.float16) for s in ((256, 63), (256, 63),
                                                                          (63, 256)))
        for e in range(6)
    }  # fmt: skip
    return write_experts(tmp_path / "large.colibri", experts, alignment=64), experts


@pytest.mark.skipif(not HAS_DIRECT, reason="no O_DIRECT on this OS")
def test_direct_reads_where_memory_cannot_hold_the_files(large, monkeypatch):
    path, experts = large
    reads = []
    _before_reads(monkeypatch, lambda direct, offset, view: reads.append(
        (direct, offset, len(view), np.frombuffer(view, np.uint8).ctypes.data)))  # fmt: skip
    assert _backends.default_io([path]) == DEFAULT_IO  # memory to spare: the default
    monkeypatch.setattr(_backends, "_cache_short", lambda nbytes: True)
    assert _backends.default_io([path]) == "read"
    with Pager(path, budget_bytes=3 * 3 * 65536, page_size_kb=64) as pager:
        assert pager.io == "read"
        for ids in ([0, 5], [1, 2, 3], [4, 0], [5]):  # the last expert ends the file
            with pager.load(0, ids) as batch:
                check(batch, experts, 0)
        assert pager.advise(0, range(6)) == 0  # the page cache is not what a load reads
    assert reads and all(d for d, *_ in reads)
    assert any(r.offset % DIRECT_ALIGN for m in open_weights(path).experts.values()
               for r in m.matrices)  # fmt: skip
    for _, offset, n, address in reads:
        assert offset % DIRECT_ALIGN == n % DIRECT_ALIGN == address % DIRECT_ALIGN == 0


@pytest.mark.skipif(not HAS_DIRECT, reason="no O_DIRECT on this OS")
def test_a_file_system_refusing_direct_reads_is_read_as_usual(large, monkeypatch):
    path, experts = large
    calls = []

    def refuse(direct, offset, view):
        calls.append(direct)
        if direct:  # as tmpfs and some FUSE file systems answer
            raise OSError(errno.EINVAL, "Invalid argument")

    _before_reads(monkeypatch, refuse)
    monkeypatch.setattr(_backends, "_cache_short", lambda nbytes: True)
    with Pager(path, budget_bytes=2 * 3 * 65536, page_size_kb=64) as pager:
        for e in range(6):
            with pager.load(0, [e]) as batch:
                check(batch, experts, 0)
    assert calls.count(True) == 1 and calls[1:] and not any(calls[1:])
