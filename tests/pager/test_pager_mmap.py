"""The mapped backends (``io="mmap"``, ``io="view"``): zero copy, pages in and out of RSS,
shared boundary pages, views across eviction and close, changed files, injected faults.

Most tests read what Linux says is mapped and resident (``/proc/self/maps``, ``smaps``,
``status``, ``io``) and are marked ``linux``; the rest run everywhere."""

import errno
import gc
import hashlib
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import numpy as np
import pytest

import colibri.pager._backends
from _support.paging import held_pages, hook_io, mapped_rss, mappings
from colibri._files import FileMap
from colibri._units import ProcessMemory
from colibri.formats import open_weights
from colibri.formats.raw import write_experts
from colibri.pager import IO_BACKENDS, FileChangedError, Pager, Trace, replay

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/maps, smaps, status or io"
)

L, E, I, H = 4, 16, 128, 128  # one expert: 3 * 128 * 128 * 2 = 96 KiB; 64 experts: 6 MiB
EXPERT = 3 * I * H * 2
MAPPED = ("mmap", "view")


def make_experts(layers, experts, inter, hidden, seed=0):
    rng = np.random.default_rng(seed)
    return {
        (lay, e): (
            rng.standard_normal((inter, hidden)).astype(np.float16),
            rng.standard_normal((inter, hidden)).astype(np.float16),
            rng.standard_normal((hidden, inter)).astype(np.float16),
        )
        for lay in range(layers)
        for e in range(experts)
    }


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    experts = make_experts(L, E, I, H)
    path = write_experts(tmp_path_factory.mktemp("m") / "experts.colibri", experts)
    # experts fill whole 64 KiB pages; the writer's 16-byte token follows the last one
    assert os.path.getsize(path) == L * E * EXPERT + 16
    return path, experts


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """3 KiB experts back to back (alignment 1 KiB): neighbours share 4 KiB pages."""
    experts = make_experts(1, 16, 16, 32, seed=5)
    path = write_experts(tmp_path_factory.mktemp("p") / "packed.colibri", experts, alignment=1024)
    return path, experts


def check(batch, experts, layer):
    for e, w in batch.items():
        for got, want in zip((w.gate, w.up, w.down), experts[(layer, e)], strict=True):
            np.testing.assert_array_equal(got, want)
            assert not got.flags.writeable


def assert_consistent(pager, io):
    """What the pager says it holds is what the layouts say, and what /proc says is mapped."""
    s = pager.stats
    keys = pager.resident()
    assert s.resident_pages == held_pages(pager.source, keys, pager.page_size, io)
    assert s.pages_loaded - s.pages_evicted == s.resident_pages
    assert s.resident_bytes == sum(pager.source.experts[k].nbytes for k in keys)
    assert s.resident_pages * pager.page_size <= pager.budget_bytes
    if io in MAPPED:
        assert mapped_rss(pager.source.files[0]) == s.resident_pages * pager.page_size


@linux
@pytest.mark.parametrize("io", MAPPED)
def test_views_point_into_the_mapping_no_copy(io, weights):
    path, experts = weights
    with Pager(path, budget_bytes=8 * EXPERT, page_size_kb=4, io=io) as pager:
        pager.load(0, [3]).release()  # first use: builds the per-expert tables
        tracemalloc.start()
        try:
            batch = pager.load(1, [2, 9])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < EXPERT // 4  # two 96 KiB experts loaded, no copy of either
        for e, w in batch.items():
            layout = pager.source.experts[(1, e)]
            for arr, ref in zip((w.gate, w.up, w.down), layout.matrices, strict=True):
                address = arr.ctypes.data
                vma = [m for m in mappings(path) if m[0] <= address < m[1]]
                assert len(vma) == 1, "the view does not lie in a mapping of the weight file"
                start, end, file_offset = vma[0]
                assert address - start + file_offset == ref.offset
                assert address + arr.nbytes <= end
        check(batch, experts, 1)
        batch.release()


def run_trace(path, io, trace, capacity_bytes, page_size_kb, policy="lru"):
    """Per-step (hits, misses, evictions) and a digest of every byte loaded."""
    steps, digest = [], hashlib.sha256()
    with Pager(path, budget_bytes=capacity_bytes, page_size_kb=page_size_kb, io=io,
               policy=policy) as pager:  # fmt: skip
        before = (0, 0, 0)
        for layer, ids in trace:
            with pager.load(layer, ids) as batch:
                for e in sorted(batch):
                    for m in (batch[e].gate, batch[e].up, batch[e].down):
                        digest.update(m.tobytes())
                del m  # a view kept alive would pin its expert
            s = pager.stats
            now = (s.hits, s.misses, s.evictions)
            steps.append(tuple(b - a for a, b in zip(before, now, strict=True)))
            before = now
        capacity = pager.capacity
    return steps, digest.hexdigest(), capacity


@linux
@pytest.mark.parametrize("page_size_kb", [4, 64])
def test_backends_give_identical_bytes_and_hit_miss_sequences(packed, page_size_kb):
    path, _ = packed
    rng = np.random.default_rng(2)
    trace = Trace((0, rng.choice(16, size=3, p=np.arange(16, 0, -1) / 136)) for _ in range(300))
    budget = 5 * page_size_kb * 1024 * (2 if page_size_kb == 4 else 1)
    results = {io: run_trace(path, io, trace, budget, page_size_kb) for io in IO_BACKENDS}
    (steps, digest, capacity), *others = results.values()
    for other in others:
        assert other == (steps, digest, capacity)
    expected = replay(trace, capacity, "lru")
    assert sum(h for h, _, _ in steps) == expected.hits and sum(m for _, m, _ in steps) == (
        expected.misses
    )


@linux
@pytest.mark.parametrize("io", MAPPED)
@pytest.mark.parametrize("page_size_kb", [4, 64])
def test_rss_follows_the_pages_held(io, page_size_kb, weights):
    path, experts = weights
    rng = np.random.default_rng(0)
    with Pager(path, budget_bytes=5 * EXPERT, page_size_kb=page_size_kb, io=io) as pager:
        assert mapped_rss(path) == 0
        for _ in range(40):
            layer = int(rng.integers(L))
            with pager.load(layer, rng.choice(E, size=2, replace=False)) as batch:
                check(batch, experts, layer)
            assert_consistent(pager, io)
        assert pager.stats.evictions > 20 and pager.stats.pages_evicted > 0
    assert mapped_rss(path) == 0 and mappings(path) == []  # closed: nothing left mapped


@linux
@pytest.mark.parametrize("io", MAPPED)
def test_shared_boundary_pages_are_counted_once_and_released_last(io, packed):
    path, experts = packed
    page = 4096
    with Pager(path, budget_bytes=4 * page, page_size_kb=4, io=io, policy="fifo") as pager:
        layout = {e: pager.source.experts[(0, e)] for e in range(16)}
        assert [layout[e].gate.offset for e in (0, 1, 9, 10)] == [0, 3072, 27648, 30720]
        assert pager.capacity == 2  # an expert touches up to 2 pages
        pager.load(0, [0]).release()  # page 0
        pager.load(0, [1]).release()  # pages 0, 1: page 0 is shared
        per_expert = 3 if io == "view" else 2  # a view maps its own copy of page 0
        assert pager.stats.resident_pages == per_expert
        assert_consistent(pager, io)
        pager.load(0, [9]).release()  # evicts expert 0 (fifo); expert 1 still holds page 0
        assert pager.resident() == [(0, 1), (0, 9)]
        assert pager.stats.resident_pages == 4 and pager.stats.pages_evicted == (
            1 if io == "view" else 0
        )
        assert_consistent(pager, io)
        pager.load(0, [10]).release()  # evicts expert 1: pages 0 and 1 go, 7 is shared now
        assert pager.resident() == [(0, 9), (0, 10)]
        assert pager.stats.resident_pages == (4 if io == "view" else 3)
        assert_consistent(pager, io)
        with pager.load(0, [9, 10]) as batch:
            check(batch, experts, 0)


@linux
@pytest.mark.parametrize("io", MAPPED)
def test_views_alive_across_eviction_and_close_read_the_right_bytes(io, packed):
    path, experts = packed
    pager = Pager(path, budget_bytes=3 * 4096 * 2, page_size_kb=4, io=io, policy="lru")
    with pager.load(0, [4, 5]) as batch:
        kept = batch[4].up[1:]  # expert 4 stays pinned while this lives
        derived = batch[5].down.T  # expert 5 shares a page with expert 4
    for e in range(16):  # every other expert passes through the third slot
        if e not in (4, 5):
            pager.load(0, [e]).release()
            assert pager.pinned() == [(0, 4), (0, 5)]
            np.testing.assert_array_equal(kept, experts[(0, 4)][1][1:])
    del derived
    gc.collect()
    pager.load(0, [0]).release()
    pager.load(0, [1]).release()  # expert 5 evicted now; its shared page stays for 4
    assert (0, 5) not in pager.resident()
    assert_consistent(pager, io)
    np.testing.assert_array_equal(kept, experts[(0, 4)][1][1:])
    pager.close()  # no BufferError, the view's mapping stays
    assert mapped_rss(path) == 0  # every page given back ...
    np.testing.assert_array_equal(kept, experts[(0, 4)][1][1:])  # ... and re-faulted on read
    assert mapped_rss(path) > 0 and pager.stats.resident_pages == 0
    del kept
    gc.collect()
    assert mappings(path) == []  # the last view took the mapping with it


@linux
def test_view_backend_maps_at_64k_granularity_like_windows(weights, monkeypatch):
    monkeypatch.setattr(colibri.pager._backends, "_VIEW_GRANULARITY", 65536)
    path, experts = weights
    with Pager(path, budget_bytes=4 * EXPERT, page_size_kb=4, io="view") as pager:
        for layer, e in [(0, 1), (0, 2), (1, 5), (2, 7), (3, 3), (0, 1), (3, 15)]:
            with pager.load(layer, [e]) as batch:
                check(batch, experts, layer)
            maps = mappings(path)
            assert len(maps) == len(pager.resident())  # one view per resident expert
            assert all(offset % 65536 == 0 for _, _, offset in maps)
            assert_consistent(pager, "view")  # the rounded-down prefix is never touched
        assert pager.stats.evictions == 3  # fifo: (0, 1), (0, 2), (1, 5)


@linux
@pytest.mark.parametrize("io", MAPPED)
def test_without_populate_read_the_pages_are_touched_instead(io, weights, monkeypatch):
    monkeypatch.setattr(FileMap, "_populate_works", True)  # restored after the test

    def older_kernel(kind, path, offset, length):
        if kind == "populate":
            raise OSError(errno.EINVAL, "Invalid argument")

    hook_io(monkeypatch, older_kernel)
    path, experts = weights
    with Pager(path, budget_bytes=3 * EXPERT, page_size_kb=4, io=io) as pager:
        for layer, e in [(0, 0), (1, 1), (2, 2), (3, 3)]:
            with pager.load(layer, [e]) as batch:
                check(batch, experts, layer)
            assert_consistent(pager, io)
    assert FileMap._populate_works is False


@linux
@pytest.mark.parametrize("io", IO_BACKENDS)
def test_injected_eio_leaves_the_pager_consistent(io, weights, monkeypatch):
    path, experts = weights
    bad = {"offset": None}

    def disk(kind, p, offset, length):
        target = bad["offset"]
        if (
            target is not None
            and kind in ("read", "populate")
            and offset <= target < offset + (length)
        ):
            raise OSError(errno.EIO, "Input/output error")

    hook_io(monkeypatch, disk)
    with Pager(path, budget_bytes=5 * EXPERT, page_size_kb=4, io=io, policy="lru") as pager:
        pager.load(0, [0, 1]).release()
        before = pager.stats
        bad["offset"] = pager.source.experts[(1, 3)].up.offset  # the middle of expert (1, 3)
        with pytest.raises(OSError, match=r"experts\.colibri") as info:
            pager.load(1, [2, 3, 4])
        assert info.value.errno == errno.EIO and not isinstance(info.value, FileChangedError)
        # expert 2 was fetched before the fault and stays; 3 failed, 4 was never fetched
        assert pager.resident() == [(0, 0), (0, 1), (1, 2)] and not pager.pinned()
        s = pager.stats
        assert (s.misses - before.misses, s.bytes_read - before.bytes_read) == (3, EXPERT)
        assert_consistent(pager, io)
        assert pager.prefetch(1, [3]) == 1 and pager.drain(timeout=30)
        with pytest.raises(OSError, match="Input/output error"):  # the prefetch's error
            pager.load(1, [3])
        assert_consistent(pager, io)
        bad["offset"] = None  # the disk recovers: the pager is fully usable
        with pager.load(1, [3, 4, 5, 6]) as batch:
            check(batch, experts, 1)
        assert_consistent(pager, io)


def test_short_reads_are_completed(weights, monkeypatch):
    path, experts = weights
    reads = []

    def short(kind, p, offset, length):
        reads.append(length)
        return min(length, 1000)

    hook_io(monkeypatch, short)
    pager = Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io="read")
    with pager, pager.load(3, [15]) as batch:
        check(batch, experts, 3)
    assert len(reads) == -(-EXPERT // 1000)


def test_read_backend_turns_a_truncation_after_the_check_into_an_error(weights, monkeypatch):
    path, experts = weights
    hook_io(monkeypatch, lambda kind, p, offset, length: 0)  # end of file at every read
    with Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io="read") as pager:
        with pytest.raises(FileChangedError, match="unexpected end of file"):
            pager.load(0, [1])
        assert pager.resident() == [] and pager.stats.resident_pages == 0


@linux
@pytest.mark.parametrize("io", MAPPED)
def test_truncation_between_the_check_and_the_mapping_raises_not_sigbus(io, tmp_path, monkeypatch):
    experts = make_experts(1, 4, I, H)
    path = write_experts(tmp_path / "t.colibri", experts)
    size = os.path.getsize(path)

    def truncate_first(kind, p, offset, length):
        if kind == "populate" and os.path.getsize(path) == size:
            with open(path, "r+b") as f:
                f.truncate(EXPERT)  # only expert 0 is left

    with Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io=io) as pager:
        hook_io(monkeypatch, truncate_first)
        with pytest.raises(FileChangedError, match="t.colibri' must not change.*size changed"):
            pager.load(0, [2])
        assert pager.resident() == [] and pager.stats.resident_pages == 0
        assert mapped_rss(path) == 0


@linux
def test_faults_and_rss_in_the_stats(weights):
    path, _ = weights
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the pages come from the disk
    os.close(fd)
    with Pager(path, budget_bytes=8 * EXPERT, page_size_kb=4, io="mmap") as pager:
        for e in range(8):
            pager.load(0, [e]).release()
        s = pager.stats
        assert s.minor_faults + s.major_faults > 0
        assert s.per_layer[0].pages_loaded == 8 * EXPERT // 4096 == s.resident_pages
        assert s.bytes_paged_in == s.bytes_read == 8 * EXPERT  # aligned: no partial page
        assert s.rss_file >= s.resident_pages * 4096 and s.rss_anon > 0


def test_bad_io_is_refused(weights):
    path, _ = weights
    with pytest.raises(ValueError, match=r"io must be one of \('mmap', 'view', 'read'\)"):
        Pager(path, budget_bytes=4 * EXPERT, io="direct")


@linux
def test_threads_load_and_prefetch_through_one_mapping(weights):
    path, experts = weights
    errors = []
    with Pager(path, budget_bytes=10 * EXPERT, page_size_kb=4, io="mmap", policy="lru") as pager:

        def work(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(60):
                    layer = int(rng.integers(L))
                    ids = rng.choice(E, size=2, replace=False)
                    pager.prefetch((layer + 1) % L, rng.choice(E, size=2, replace=False))
                    with pager.load(layer, ids) as batch:
                        check(batch, experts, layer)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and pager.drain(timeout=30)
        assert_consistent(pager, "mmap")


RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    from colibri.pager import Pager
    from colibri._units import process_memory

    path, budget, page_kb, io = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pager = Pager(path, budget_bytes=budget, page_size_kb=page_kb, policy="lru", io=io)
    def rss():
        m = process_memory()
        return m.file + m.anon

    base = rss()
    worst = 0
    for layer in range(8):
        for e in range(16):
            with pager.load(layer, [e, (e + 5) % 16]) as b:
                b[e].gate.sum(), b[e].down.sum()
            worst = max(worst, rss() - base)
    s = pager.stats
    assert s.bytes_read > 8 * budget, s
    print(worst, s.peak_resident_pages * s.page_size)
    """
)


@linux
@pytest.mark.parametrize(("io", "page_size_kb"), [("mmap", 4), ("mmap", 64), ("view", 4)])
def test_streaming_8x_the_budget_keeps_rss_within_it(tmp_path, io, page_size_kb):
    # 8 layers x 16 experts x 512 KiB = 64 MiB of experts; budget 8 MiB.
    one = (np.ones((512, 256), np.float16),) * 2 + (np.ones((256, 512), np.float16),)
    path = write_experts(
        tmp_path / "big.colibri", (((lay, e), one) for lay in range(8) for e in range(16))
    )
    budget = 8 << 20
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, path, str(budget), str(page_size_kb), io],
        capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path,
    )  # fmt: skip
    worst, held = map(int, out.stdout.split())
    assert held <= budget
    # a populate may map a whole page-cache folio (up to 2 MiB) on each side of the run
    # before the pager trims what it does not hold: 4 MiB above the budget at worst
    assert worst <= budget + (4 << 20), (worst, budget)


@linux
def test_mmap_is_the_default_on_linux(weights):
    path, _ = weights
    assert colibri.pager.DEFAULT_IO == "mmap"
    with Pager(path, budget_bytes=2 * EXPERT) as pager:
        assert pager.io == "mmap" and pager.stats.io == "mmap"
    assert mmap.PAGESIZE <= 64 * 1024
    assert open_weights(path).max_expert_nbytes == EXPERT


def _page_runs(source, key, page_size):
    """Byte ranges ``[(offset, length)]`` of the pages expert ``key`` touches, merged."""
    runs: list[list[int]] = []
    for ref in sorted(source.experts[key].matrices, key=lambda r: r.offset):
        first = ref.offset // page_size * page_size
        end = -(-(ref.offset + ref.nbytes) // page_size) * page_size
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([first, end])
    return [(a, b - a) for a, b in runs]


@linux
@pytest.mark.parametrize("fixture", ["weights", "packed"])
def test_a_miss_reads_exactly_the_missed_experts_pages(fixture, request, monkeypatch):
    """The mapping is MADV_RANDOM (no fault reads around), and a miss reads (WILLNEED) and
    maps (POPULATE_READ) exactly its expert's pages; a hit asks for nothing."""
    path, experts = request.getfixturevalue(fixture)
    calls = []
    hook_io(monkeypatch, lambda kind, p, offset, length: calls.append((kind, offset, length)))
    monkeypatch.setattr(FileMap, "_populate_works", True)
    ps = 4096
    with Pager(path, budget_bytes=64 * EXPERT, page_size_kb=4, io="mmap", policy="fifo") as pager:
        assert calls == [("random", 0, os.path.getsize(path))]
        layers = sorted({lay for lay, _ in experts})
        for key in [(layers[0], 0), (layers[-1], 3), (layers[0], 0), (layers[0], 1)]:
            hit = pager.resident().__contains__(key)
            calls.clear()
            with pager.load(key[0], [key[1]]) as batch:
                check(batch, experts, key[0])
            want = [] if hit else _page_runs(pager.source, key, ps)
            assert [(o, n) for k, o, n in calls if k == "willneed"] == want
            assert [(o, n) for k, o, n in calls if k == "populate"] == want
            assert {k for k, _, _ in calls} <= {"willneed", "populate", "drop"}  # drop: settle


def _storage_reads():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@linux
@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_a_cold_miss_reads_from_storage_only_its_pages(tmp_path):
    """Measured, not mocked: with the page cache emptied, loading experts reads from the
    device (``/proc/self/io``) no more than their pages, however large the readahead."""
    experts = make_experts(2, 32, I, H, seed=3)  # 6 MiB
    path = str(write_experts(tmp_path / "cold.colibri", experts))
    _evict(path)
    before = _storage_reads()
    with open(path, "rb") as f:
        f.read(EXPERT)
    if _storage_reads() - before < EXPERT:  # tmpfs, or a file system /proc/self/io misses
        pytest.skip("this file system's reads are not counted in /proc/self/io read_bytes")
    keys = [(0, 5), (0, 17), (1, 9), (1, 30)]
    with Pager(path, budget_bytes=8 * EXPERT, page_size_kb=4, io="mmap") as pager:
        _evict(path)
        before = _storage_reads()
        for layer, e in keys:
            with pager.load(layer, [e]) as batch:
                check(batch, experts, layer)
        read = _storage_reads() - before
        asked = sum(n for k in keys for _, n in _page_runs(pager.source, k, 4096))
    assert asked <= read <= 1.1 * asked, (read, asked)


@linux
@pytest.mark.parametrize("io", ["mmap", "read"])
def test_advise_reads_ahead_without_touching_the_budget(weights, io, monkeypatch):
    """advise() hands exactly the missing experts' pages to the OS (WILLNEED) and nothing
    else: no slot, no residency, no eviction, no hit or miss."""
    path, experts = weights
    calls = []
    if io == "mmap":
        hook_io(monkeypatch, lambda kind, p, offset, length: calls.append((kind, offset, length)))
    else:
        real = os.posix_fadvise
        monkeypatch.setattr(
            os, "posix_fadvise",
            lambda fd, offset, length, advice: calls.append(("willneed", offset, length))
            if advice == os.POSIX_FADV_WILLNEED else real(fd, offset, length, advice),
        )  # fmt: skip
    with Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io=io, policy="lru") as pager:
        with pager.load(0, [1]):
            pass
        before, held = pager.stats, pager.resident()
        calls.clear()
        assert pager.advise(0, [1, 2, 3, 2]) == 2  # 1 is resident: skipped
        after = pager.stats
        assert pager.resident() == held
        for name in ("hits", "misses", "evictions", "prefetched", "bytes_read", "pages_loaded"):
            assert getattr(after, name) == getattr(before, name), name
        assert after.advised == before.advised + 2
        asked = sorted((o, n) for k, o, n in calls if k == "willneed")
        if io == "mmap":
            want = sorted(r for e in (2, 3) for r in _page_runs(pager.source, (0, e), 4096))
        else:
            want = sorted((r.offset, r.nbytes) for e in (2, 3)
                          for r in pager.source.experts[(0, e)].matrices)  # fmt: skip
        assert asked == want
        assert {k for k, _, _ in calls} == {"willneed"}
        with pytest.raises(KeyError):
            pager.advise(0, [10**6])
    with pytest.raises(ValueError, match="closed"):
        pager.advise(0, [2])


@linux
@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_an_advised_expert_loads_from_the_page_cache(tmp_path):
    """Measured: with the page cache emptied, advise() is where the device is read; the
    load that follows reads nothing more from it."""
    experts = make_experts(1, 16, I, H, seed=4)
    path = str(write_experts(tmp_path / "ahead.colibri", experts))
    _evict(path)
    before = _storage_reads()
    with open(path, "rb") as f:
        f.read(EXPERT)
    if _storage_reads() - before < EXPERT:
        pytest.skip("this file system's reads are not counted in /proc/self/io read_bytes")
    with Pager(path, budget_bytes=4 * EXPERT, page_size_kb=4, io="mmap") as pager:
        _evict(path)
        before = _storage_reads()
        assert pager.advise(0, [3, 7]) == 2
        advised = _storage_reads() - before
        before = _storage_reads()
        with pager.load(0, [3, 7]) as batch:
            check(batch, experts, 0)
        loaded = _storage_reads() - before
    assert advised >= 2 * EXPERT and loaded <= EXPERT // 8, (advised, loaded)


@linux
@pytest.mark.parametrize("short", [True, False])
def test_evicted_pages_leave_the_page_cache_where_memory_cannot_hold_the_files(
    weights, monkeypatch, short
):
    """Under a memory limit smaller than the files, an evicted expert's pages are paged out
    (MADV_PAGEOUT) before they are unmapped; with memory for the files, only unmapped."""
    from colibri import _memory
    from colibri._memory import MemoryLimit

    path, experts = weights
    in_use = 300 << 20
    limit = in_use + (os.path.getsize(path) // 2 if short else os.path.getsize(path) * 2)
    monkeypatch.setattr(_memory, "cgroup_limit", lambda: MemoryLimit(limit, "fake"))
    monkeypatch.setattr(_memory, "mem_available", lambda: 1 << 40)
    monkeypatch.setattr(colibri.pager._backends, "process_memory",
                        lambda: ProcessMemory(in_use, in_use, None, None))  # fmt: skip
    calls = []
    hook_io(monkeypatch, lambda kind, p, offset, length: calls.append((kind, offset, length)))
    monkeypatch.setattr(FileMap, "_pageout_works", True)
    with Pager(path, budget_bytes=EXPERT, page_size_kb=4, io="mmap", policy="fifo") as pager:
        with pager.load(0, [0]) as batch:
            check(batch, experts, 0)
        calls.clear()
        with pager.load(0, [1]) as batch:  # evicts expert 0
            check(batch, experts, 0)
        runs = _page_runs(pager.source, (0, 0), 4096)
        out = [(o, n) for k, o, n in calls if k == "pageout"]
        dropped = [(o, n) for k, o, n in calls if k == "drop"]
        assert out == (runs if short else [])
        assert all(run in dropped for run in runs)  # unmapped either way
        if short:  # paged out before unmapped
            assert calls.index(("pageout", *runs[0])) < calls.index(("drop", *runs[0]))


@linux
def test_pageout_on_an_old_kernel_only_unmaps(weights, monkeypatch):
    """EINVAL from MADV_PAGEOUT (Linux < 5.4) turns it off; the drop still happens. Another
    error is raised."""
    path, _ = weights
    calls = []

    def before(kind, p, offset, length):
        calls.append(kind)
        if kind == "pageout":
            raise OSError(errno.EINVAL if len(calls) < 3 else errno.EIO, "refused")

    hook_io(monkeypatch, before)
    monkeypatch.setattr(FileMap, "_pageout_works", True)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = FileMap(path, fd, 0, os.path.getsize(path))
    finally:
        os.close(fd)
    try:
        calls.clear()
        assert m.drop(0, 4096, pageout=True)
        assert calls == ["pageout", "drop"] and not FileMap._pageout_works
        assert m.drop(0, 4096, pageout=True)
        assert calls == ["pageout", "drop", "drop"]
        monkeypatch.setattr(FileMap, "_pageout_works", True)
        with pytest.raises(OSError, match="refused"):
            m.drop(0, 4096, pageout=True)
    finally:
        m.close()
