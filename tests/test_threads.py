"""Threads under load: several threads route, page, prefetch and close at once for a bounded
time; every result is checked against a serial run, every wait has a timeout (a deadlock fails
the test instead of hanging it), and the only exceptions allowed are documented ones."""

from __future__ import annotations

import collections
import os
import sys
import threading

import numpy as np
import pytest

import colibri
from colibri import BudgetError, Pager, UsageStats
from colibri.formats.raw import write_experts
from colibri.layer import run_experts

E, K, L, I, H = 16, 2, 2, 8, 12
SECONDS = 1.5
JOIN = 60.0  # a thread still alive this long after the stop is a deadlock


def _batches(count: int):
    rng = np.random.default_rng(5)
    return [rng.standard_normal((int(rng.integers(1, 40)), E)).astype(np.float32)
            for _ in range(count)]  # fmt: skip


def _experts():
    rng = np.random.default_rng(9)
    return {
        (layer, e): (
            rng.standard_normal((I, H)).astype(np.float32),
            rng.standard_normal((I, H)).astype(np.float32),
            rng.standard_normal((H, I)).astype(np.float32),
        )
        for layer in range(L)
        for e in range(E)
    }


class Crew:
    """Threads running ``work(stop)`` until stopped; errors collected, joins bounded."""

    def __init__(self):
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.done = collections.Counter()

    def add(self, name, work, *args):
        def run():
            try:
                while not self.stop.is_set():
                    work(*args)
                    self.done[name] += 1
            except BaseException as error:  # noqa: BLE001 - reported by finish()
                self.errors.append(error)
                self.stop.set()

        self.threads.append(threading.Thread(target=run, name=name, daemon=True))

    def run(self, seconds: float):
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often: races show up in seconds
        try:
            for thread in self.threads:
                thread.start()
            self.stop.wait(seconds)
            self.stop.set()
            for thread in self.threads:
                thread.join(JOIN)
        finally:
            sys.setswitchinterval(interval)
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"deadlock: {alive} still running {JOIN} s after the stop"
        if self.errors:
            raise self.errors[0]
        idle = [t.name for t in self.threads if not self.done[t.name]]
        assert not idle, f"{idle} never finished one iteration in {seconds} s"


def test_concurrent_routing_matches_serial_and_counts_every_token():
    batches = _batches(24)
    ctx = colibri.init(config=colibri.Config(num_experts=E, top_k=K, collect_stats=True))
    serial = [ctx.route(x) for x in batches]
    per_batch = [UsageStats.from_ids(ids, E) for ids, _ in serial]
    ctx.reset_stats()
    crew = Crew()
    routed = collections.Counter()
    lock = threading.Lock()

    def route(i, rng):
        j = int(rng.integers(len(batches)))
        if i % 2:  # caller-owned buffers on every other thread
            rows = len(batches[j])
            out = (np.empty((rows, K), np.int32), np.empty((rows, K), np.float32))
            ids, weights = ctx.route(batches[j], out=out)
        else:
            ids, weights = ctx.route(batches[j])
        np.testing.assert_array_equal(ids, serial[j][0])
        np.testing.assert_array_equal(weights, serial[j][1])
        with lock:
            routed[j] += 1

    for i in range(4):
        crew.add(f"route-{i}", route, i, np.random.default_rng(i))
    crew.run(SECONDS)
    assert sum(routed.values()) > 4
    expected = UsageStats.sum(_scaled(per_batch[j], n) for j, n in routed.items())
    assert ctx.stats == expected  # every token counted once, none lost to a race


def _scaled(stats: UsageStats, n: int) -> UsageStats:
    """The statistics of ``n`` routings of the same tokens."""
    return UsageStats(stats.counts * n, stats.coactivation * n, stats.tokens * n)


@pytest.fixture
def weights(tmp_path):
    experts = _experts()
    return write_experts(tmp_path / "w.colibri", experts), experts


def _pager_work(pager, experts, batches, ctx, rng, kept):
    layer = int(rng.integers(L))
    ids, _ = ctx.route(batches[int(rng.integers(len(batches)))][:3])
    try:
        with pager.load(layer, ids) as batch:
            for e in np.unique(ids):
                w = batch[int(e)]
                gate, up, down = experts[(layer, int(e))]
                np.testing.assert_array_equal(w.gate, gate)
                np.testing.assert_array_equal(w.up, up)
                np.testing.assert_array_equal(w.down, down)
                if rng.integers(8) == 0 and len(kept) < 4:  # a view kept past the batch
                    kept.append(((layer, int(e)), w.down, down))
    except BudgetError:  # documented: every slot pinned by the other threads' live views
        pass


def _prefetch_work(pager, rng):
    pager.prefetch(int(rng.integers(L)), rng.integers(0, E, 3))
    if rng.integers(4) == 0:
        assert pager.drain(timeout=JOIN)


def _monitor_work(pager):
    """Snapshots taken while the others work must be consistent: every counter moves under
    the lock, so a snapshot never sees half of an update."""
    s = pager.stats
    assert s.resident_pages == s.pages_loaded - s.pages_evicted, s
    for name in ("hits", "misses", "pages_loaded", "pages_evicted"):
        assert getattr(s, name) == sum(getattr(p, name) for p in s.per_layer.values()), name
    assert len(pager.resident()) <= pager.capacity
    assert sum(pager.usage().values()) >= s.hits + s.misses


def test_paging_and_prefetching_from_several_threads(weights):
    path, experts = weights
    batches = _batches(8)
    ctx = colibri.init(E, K)
    kept: list = []
    # a load that finds every slot pinned by the others' kept views waits wait_timeout, then
    # raises the documented BudgetError: 1 s, not the default minute, when the crew stops
    with Pager(path, budget_bytes=12 * (2 * I * H + H * I) * 4, page_size_kb=4,
               policy="lru", wait_timeout=1.0) as pager:  # fmt: skip
        crew = Crew()
        for i in range(3):
            crew.add(f"load-{i}", _pager_work, pager, experts, batches, ctx,
                     np.random.default_rng(i), kept)  # fmt: skip
        crew.add("prefetch", _prefetch_work, pager, np.random.default_rng(7))
        crew.add("monitor", _monitor_work, pager)
        crew.run(SECONDS)
        assert pager.drain(timeout=JOIN)
        stats = pager.stats
        assert stats.hits + stats.misses > 0
        _monitor_work(pager)
        # every pin was given back but the kept views' own: no pin count lost to a race
        assert pager.pinned() == sorted({key for key, _, _ in kept})
    for _, view, expected in kept:  # views outlive their batch, and the pager
        np.testing.assert_array_equal(view, expected)


def test_close_while_loading_and_prefetching(weights):
    path, experts = weights
    batches = _batches(8)
    ctx = colibri.init(E, K)
    kept: list = []
    for round_ in range(3):
        pager = Pager(path, budget_bytes=12 * (2 * I * H + H * I) * 4, page_size_kb=4)
        crew = Crew()

        def closed_is_documented(work, pager, *args):
            try:
                work(pager, *args)
            except ValueError as error:  # documented: "later loads raise ValueError"
                assert pager.closed and "closed" in str(error), error

        for i in range(3):
            crew.add(f"load-{i}", closed_is_documented, _pager_work, pager, experts, batches,
                     ctx, np.random.default_rng(10 * round_ + i), kept)  # fmt: skip
        crew.add("prefetch", closed_is_documented, _prefetch_work, pager,
                 np.random.default_rng(round_))  # fmt: skip
        closer = threading.Timer(0.2 + 0.2 * round_, pager.close)
        closer.start()
        crew.run(0.4 + 0.2 * round_ + 0.3)
        closer.join(JOIN)
        assert not closer.is_alive()
        assert pager.closed
        pager.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            pager.load(0, [0])
    for _, view, expected in kept:
        np.testing.assert_array_equal(view, expected)


# -- close() racing the mapping of one expert: the window held open, so it always shows --------


def _load_in_thread(pager, layer, expert, expected):
    """``pager.load(layer, [expert])`` in a thread; ``result[0]``: "ok" when it returned the
    expected bytes, the exception otherwise, ``AssertionError`` for wrong bytes."""
    result: list = []

    def run():
        try:
            with pager.load(layer, [expert]) as batch:
                w = batch[expert]
                for got, want in zip((w.gate, w.up, w.down), expected, strict=True):
                    np.testing.assert_array_equal(got, want)
            result.append("ok")
        except BaseException as error:  # noqa: BLE001 - judged by the test
            result.append(error)

    thread = threading.Thread(target=run, name="load", daemon=True)
    thread.start()
    return thread, result


def _documented(outcome) -> bool:
    """A load that raced close(): the right bytes, or the documented ``ValueError``."""
    return outcome == "ok" or isinstance(outcome, ValueError) and "closed" in str(outcome)


def test_close_waits_for_an_madvise_in_progress(weights, monkeypatch):
    """io="mmap": a load is inside ``madvise`` on the file's mapping when another thread
    closes the Pager. close() must wait for the call (FileMap counts calls in progress) rather
    than unmap under it; the load then returns the right bytes or raises ValueError."""
    from _support.paging import hook_io

    path, experts = weights
    inside, release = threading.Event(), threading.Event()

    def before(kind, *_):
        if kind in ("willneed", "populate") and not inside.is_set():
            inside.set()
            assert release.wait(JOIN), "the test never released the load"

    with Pager(path, budget_bytes=1 << 20, page_size_kb=4, io="mmap") as pager:
        hook_io(monkeypatch, before)
        loader, result = _load_in_thread(pager, 1, 5, experts[(1, 5)])
        assert inside.wait(JOIN), "the load never reached madvise"
        closer = threading.Thread(target=pager.close, name="close", daemon=True)
        closer.start()
        closer.join(0.5)
        waited = closer.is_alive()  # before release: close() cannot have unmapped yet
        release.set()
        for thread in (loader, closer):
            thread.join(JOIN)
            assert not thread.is_alive(), f"deadlock: {thread.name} still running"
    assert waited, "close() unmapped the file while a load was inside madvise on it"
    assert result and _documented(result[0]), result


def test_close_waits_for_a_mapping_being_made(weights, monkeypatch):
    """io="view": a load is creating the mapping of an expert (its descriptor checked open)
    when another thread closes the Pager, and something else opens a file at once, which may
    get the descriptor number close() freed. The load must map the weight file, never the
    other one, and never fail on a closed descriptor: close() waits for the mapping
    (the backend's descriptor lock), then closes."""
    import colibri.pager._backends as pager_module

    path, experts = weights
    inside, reused = threading.Event(), threading.Event()
    real = pager_module.FileMap

    class Held(real):
        def __init__(self, *args):
            if not inside.is_set():
                inside.set()
                reused.wait(JOIN)  # close() holds on the lock meanwhile, unless it is gone
            super().__init__(*args)

    decoy = os.path.join(os.path.dirname(path), "decoy.bin")
    with open(decoy, "wb") as f:  # another file, other bytes, larger than the weights
        f.write(b"\x5a" * (4 << 20))
    with Pager(path, budget_bytes=1 << 20, page_size_kb=4, io="view") as pager:
        monkeypatch.setattr(pager_module, "FileMap", Held)
        loader, result = _load_in_thread(pager, 0, 3, experts[(0, 3)])
        assert inside.wait(JOIN), "the load never reached the mapping"
        closer = threading.Thread(target=pager.close, name="close", daemon=True)
        closer.start()
        closer.join(0.5)  # returns at once when nothing makes close() wait
        fd = os.open(decoy, os.O_RDONLY)  # the lowest free number: close()'s, if it freed one
        try:
            reused.set()
            for thread in (loader, closer):
                thread.join(JOIN)
                assert not thread.is_alive(), f"deadlock: {thread.name} still running"
        finally:
            os.close(fd)
    assert result and _documented(result[0]), result


def test_threads_wait_for_slots_other_threads_pin(weights):
    """Three threads generating on one pager whose budget holds one expert: each waits for the
    slot the others pin while they compute (never a BudgetError about views it does not hold),
    and every result is the serial one."""
    path, _ = weights
    rng = np.random.default_rng(3)
    tokens = [
        (int(rng.integers(L)), rng.standard_normal((2, H)).astype(np.float32),
         np.stack([rng.choice(E, K, replace=False) for _ in range(2)]),
         rng.random((2, K)).astype(np.float32))
        for _ in range(30)
    ]  # fmt: skip
    with Pager(path, budget_bytes=1 << 30, page_size_kb=4) as probe:
        slot = probe.slot_bytes
    with Pager(path, budget_bytes=slot, page_size_kb=4, wait_timeout=5.0) as pager:
        assert pager.capacity == 1
        expected = [run_experts(pager, *t, num_experts=E) for t in tokens]
        results: dict[int, list] = {}
        errors: list[BaseException] = []

        def generate(n):
            try:
                results[n] = [run_experts(pager, *t, num_experts=E) for t in tokens]
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=generate, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        for n in range(3):
            for got, want in zip(results[n], expected, strict=True):
                np.testing.assert_array_equal(got, want)
        assert pager.pinned() == []


_HELPERS = r"""
import os, sys
import numpy as np
from colibri import _pool
from colibri.layer import expert_ffn, half_linear, quant_linear, quantize, rms_norm
import colibri

def helpers():
    return len(os.listdir("/proc/self/task"))

rng = np.random.default_rng(0)
x = rng.standard_normal((1, 512)).astype(np.float32)
bits = (rng.integers(0, 2**14, (512, 512)) | 0x3C00).astype(np.uint16)
before = helpers()
counts = []
for call in (
    lambda: half_linear(x, bits, "float16", None, 3),  # colibri.layer._ffn
    lambda: quant_linear(x, quantize(rng.standard_normal((512, 512)).astype(np.float32),
                                     "q8_0"), "q8_0", None, 3),  # _quant
    lambda: colibri.init(64, 2, routing_threads=3).route(
        rng.standard_normal((4096, 64)).astype(np.float32)),  # colibri._core
):
    call()
    counts.append(helpers() - before)
print(_pool.POOL is not None, counts)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_every_module_runs_on_one_pool():
    """Kernels of three compiled modules, each asking for 3 threads: two helper threads in
    all, started by the first and used by the others (a pool a module would start six, each
    spinning for its module's next call on the same spare cores)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _HELPERS], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split(maxsplit=1)  # fmt: skip
    assert out == ["True", "[2, 2, 2]\n"]
