"""A load interrupted at any phase (Ctrl-C, any exception) leaves every slot it claimed failed
or ready, never loading, and no pin behind: the next load does not block for ever. Waits for
slots and for other threads' reads are bounded by ``wait_timeout``."""

import contextlib
import threading
import time

import numpy as np
import pytest

from _support.paging import hook_io
from colibri.formats.raw import write_experts
from colibri.pager import IO_BACKENDS, BudgetError, Pager

E, I, H = 6, 32, 64  # one float16 expert: 3 * 32 * 64 * 2 = 12 KiB, three 4 KiB pages
EXPERT = 3 * I * H * 2


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    rng = np.random.default_rng(0)
    experts = {
        (0, e): (
            rng.standard_normal((I, H)).astype(np.float16),
            rng.standard_normal((I, H)).astype(np.float16),
            rng.standard_normal((H, I)).astype(np.float16),
        )
        for e in range(E)
    }
    return write_experts(tmp_path_factory.mktemp("i") / "w.colibri", experts), experts


def _bounded(fn, seconds=20.0):
    """``fn()`` in a thread; its result, or a failure (not a hung suite) if it blocks."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "the load blocked: a slot was left loading or pinned"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _same(batch, experts, ids):
    for e in ids:
        for got, want in zip(batch[e], experts[(0, e)], strict=True):
            np.testing.assert_array_equal(got, want)


# Every I/O call a load makes, per backend: the read into the pool; the mapping's read-ahead,
# its population and the drop of what the kernel mapped around the expert.
PHASES = [("read", "read"), ("mmap", "willneed"), ("mmap", "populate"), ("mmap", "drop"),
          ("view", "willneed"), ("view", "populate")]  # fmt: skip


@pytest.mark.parametrize("io, phase", PHASES)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_load_leaves_no_slot_loading(weights, monkeypatch, io, phase, exc):
    path, experts = weights
    armed = [True]

    def interrupt(kind, p, offset, length):
        if kind == phase and armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            raise exc("interrupted")

    with Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io=io) as pager:
        hook_io(monkeypatch, interrupt)
        with contextlib.suppress(exc):
            pager.load(0, [1, 2]).release()
        if armed[0]:
            armed[0] = False
            pytest.skip(f"io={io!r} made no {phase!r} call in this load")
        assert pager.pinned() == []
        batch = _bounded(lambda: pager.load(0, [1, 2]))  # the same experts, again
        with batch:
            _same(batch, experts, [1, 2])
        with _bounded(lambda: pager.load(0, [3, 4])) as batch:  # the other slots too
            _same(batch, experts, [3, 4])
        assert pager.pinned() == []


@pytest.mark.parametrize("io", IO_BACKENDS)
def test_an_interrupted_wait_for_another_threads_read_drops_its_pins(weights, monkeypatch, io):
    path, experts = weights
    reading, go = threading.Event(), threading.Event()

    def slow(kind, p, offset, length):
        if threading.current_thread().name == "reader" and kind in ("read", "populate"):
            reading.set()
            go.wait(20)

    real_wait = threading.Event.wait

    def interrupted_wait(self, timeout=None):
        if threading.current_thread() is threading.main_thread() and not self.is_set():
            raise KeyboardInterrupt("interrupted while waiting")
        return real_wait(self, timeout)

    with Pager(path, budget_bytes=3 * EXPERT, page_size_kb=4, io=io) as pager:
        hook_io(monkeypatch, slow)
        reader = threading.Thread(target=lambda: pager.load(0, [1]).release(), name="reader")
        reader.start()
        assert reading.wait(20)
        monkeypatch.setattr(threading.Event, "wait", interrupted_wait)
        with pytest.raises(KeyboardInterrupt):
            pager.load(0, [0, 1])  # reads 0, then waits for the reader's 1
        monkeypatch.setattr(threading.Event, "wait", real_wait)
        go.set()
        reader.join(20)
        assert pager.pinned() == []  # expert 0's pin and the wait's pin on 1 were dropped
        with _bounded(lambda: pager.load(0, [0, 1, 2])) as batch:
            _same(batch, experts, [0, 1, 2])


@pytest.mark.parametrize("io", IO_BACKENDS)
def test_a_wait_for_another_threads_read_is_bounded(weights, monkeypatch, io):
    path, experts = weights
    reading, go = threading.Event(), threading.Event()

    def stuck(kind, p, offset, length):
        if threading.current_thread().name == "reader" and kind in ("read", "populate"):
            reading.set()
            go.wait(20)  # a disk that does not answer

    with Pager(path, budget_bytes=2 * EXPERT, page_size_kb=4, io=io, wait_timeout=0.2) as pager:
        hook_io(monkeypatch, stuck)
        reader = threading.Thread(target=lambda: pager.load(0, [1]).release(), name="reader")
        reader.start()
        assert reading.wait(20)
        with pytest.raises(TimeoutError, match=r"expert \(0, 1\).*wait_timeout=0.2"):
            _bounded(lambda: pager.load(0, [1]))
        go.set()
        reader.join(20)
        with pager.load(0, [1]) as batch:
            _same(batch, experts, [1])
        assert pager.pinned() == []


def test_a_wait_for_slots_other_threads_pin_is_bounded(weights):
    path, _ = weights
    with Pager(path, budget_bytes=EXPERT, page_size_kb=4, wait_timeout=0.2) as pager:
        held = _bounded(lambda: pager.load(0, [1]))  # another thread's views, kept
        with pytest.raises(BudgetError, match=r"experts \[2\].*other threads.*wait_timeout"):
            pager.load(0, [2])
        del held


def test_close_wakes_a_load_waiting_for_a_slot(weights):
    """A load waiting for slots that other threads pin learns of close() at once: a
    ValueError naming the close, not a sleep until wait_timeout (an hour here)."""
    path, _ = weights
    pager = Pager(path, budget_bytes=EXPERT, page_size_kb=4, wait_timeout=3600)
    held = pager.load(0, [1])  # this thread's views, kept: the slot is pinned
    result: list = []

    def load():
        try:
            pager.load(0, [2])
        except BaseException as exc:  # noqa: BLE001 (judged below)
            result.append(exc)

    waiting = threading.Thread(target=load, daemon=True)
    waiting.start()
    time.sleep(0.2)  # the load is waiting for the slot held's views pin
    assert waiting.is_alive() and not result, result
    pager.close()
    waiting.join(10)
    assert not waiting.is_alive(), "close() left a load waiting for wait_timeout"
    assert isinstance(result[0], ValueError) and "closed" in str(result[0]), result
    del held


def test_a_thread_that_pins_every_slot_itself_gets_the_error_at_once(weights):
    path, _ = weights

    def pin_then_load(pager):
        with pager.load(0, [1]), pytest.raises(BudgetError, match="views of this thread"):
            pager.load(0, [2])  # waiting for its own views would never end

    with Pager(path, budget_bytes=EXPERT, page_size_kb=4, wait_timeout=3600) as pager:
        _bounded(lambda: pin_then_load(pager))


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_wait_timeout_is_checked(weights, value):
    path, _ = weights
    with pytest.raises((TypeError, ValueError), match="Pager\\(\\): wait_timeout must be"):
        Pager(path, budget_bytes=EXPERT, page_size_kb=4, wait_timeout=value)
