"""Held experts (:class:`colibri.layer.HeldExperts`): steps with no load, the same bits as
:func:`run_experts`, the pager's counters and file checks kept (:meth:`Pager.reuse`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from colibri import FileChangedError, FormatError, Pager
from colibri.layer import QUANT_KERNEL_MAX_ROWS, HeldExperts, InMemoryExperts, _ffn, run_experts

pytest.importorskip("gguf")
from _support.blocks import random_blocks, write_gguf  # noqa: E402

E, H, I = 6, 256, 256


def _file(tmp_path, rng, qtype="q4_k", down_type="q6_k", corrupt=None):
    def stack(t, rows, values):
        return np.stack([random_blocks(rng, t, rows, values // 256 if "_k" in t else values // 32)
                         for _ in range(E)])  # fmt: skip

    gate, up, down = stack(qtype, I, H), stack(qtype, I, H), stack(down_type, H, I)
    if corrupt is not None:  # expert 2's down: a NaN float16 scale in row 5, block 3
        size = down.shape[2] // (I // 32)
        down[2, 5, size * 3 : size * 3 + 2] = np.array([np.nan], np.float16).view(np.uint8)
    path = tmp_path / f"{qtype}-{down_type}.gguf"
    write_gguf(path, [((qtype, gate), (qtype, up), (down_type, down))])
    return path


def _steps(rng, T, count=6, k=2):
    for _ in range(count):
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
        if T > 1:
            ids[1, 0] = -1  # no expert
        weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
        yield rng.standard_normal((T, H)).astype(np.float32), ids, weights


def _bf16(a):  # float32 -> bfloat16 bits, nearest even (as torch rounds)
    bits = a.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kinds", [("q4_k", "q6_k"), ("q8_0", "q8_0"), ("q4_0", "q4_0")])
def test_held_steps_are_run_experts_bits_and_count_as_loads_do(tmp_path, kinds, T):
    """Step after step, a held layer gives run_experts' float32 sums bit for bit, and its
    pager counts the same hits, misses and uses as one that loads every step."""
    rng = np.random.default_rng(len(kinds[0]) + T)
    path = _file(tmp_path, rng, *kinds)
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as ours, \
            Pager(path, budget_bytes=1 << 24, page_size_kb=4) as loads:  # fmt: skip
        held = HeldExperts(ours, 0, num_experts=E, num_threads=2)
        for x, ids, weights in _steps(rng, T, k=1 + T):  # k = 4: sums in expert order
            want = run_experts(loads, 0, x, ids, weights, num_experts=E, num_threads=2)
            got = held(x, ids, weights)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        a, b = ours.stats, loads.stats
        assert (a.hits, a.misses) == (b.hits, b.misses) and a.hits > 0
        assert ours.usage() == loads.usage()
        assert ours.pinned() == ours.resident()  # held: every loaded expert stays pinned
        held.release()
        assert ours.pinned() == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_in_and_out_round_once(tmp_path, dtype):
    """x, weights and the result as half-precision bits: the float32 step on the same values,
    rounded once to the dtype; routing weights in float32 are taken as they are, or rounded
    to the dtype first (``rounded=True``: a router's ``.to(dtype)``), on the first step's
    load and on the held experts' native step alike."""
    rng = np.random.default_rng(5)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    if dtype == "bfloat16":
        to_bits, to_float = _bf16, lambda b: (b.astype(np.uint32) << 16).view(np.float32)
    else:
        to_bits = lambda a: a.astype(np.float16).view(np.uint16)  # noqa: E731
        to_float = lambda b: b.view(np.float16).astype(np.float32)  # noqa: E731
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as pager:
        held = HeldExperts(pager, 0, num_experts=E)
        rounding = HeldExperts(pager, 0, num_experts=E)  # its first step loads
        for x, ids, weights in _steps(rng, 2):
            weights[0, 0] = np.uint32(0x3E9B8000).view(np.float32)  # bfloat16: a tie, to even
            xb, wb = to_bits(x), to_bits(weights)
            got = rounding(xb, ids, weights, dtype=dtype, rounded=True)
            want = run_experts(pager, 0, to_float(xb), ids, to_float(wb), num_experts=E)
            np.testing.assert_array_equal(got, to_bits(want))
            out = np.full(xb.shape, 7, np.uint16)
            got = held(xb, ids, wb, dtype=dtype, out=out)
            assert got is out
            np.testing.assert_array_equal(got, to_bits(want))
            plain = held(xb, ids, to_float(wb), dtype=dtype)  # float32 routing weights
            np.testing.assert_array_equal(plain, to_bits(want))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_experts_are_run_experts_bits(dtype, monkeypatch):
    """Half-precision experts held run in the native step too (no step of the numpy plan
    after the first): still run_experts' bits, and still no load after the first."""
    from colibri.layer import _engine

    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        store_dtype = ml_dtypes.bfloat16
    else:
        store_dtype = np.float16
    rng = np.random.default_rng(6)
    shapes = ((E, 64, 32), (E, 64, 32), (E, 32, 64))
    experts = InMemoryExperts(*((rng.standard_normal(s) / 8).astype(store_dtype) for s in shapes))
    loads = []
    load = experts.load
    experts.load = lambda layer, ids: loads.append(list(ids)) or load(layer, ids)
    held = HeldExperts(experts, 0, num_experts=E)
    for step in range(4):
        if step == 1:  # held: the numpy plan never again
            monkeypatch.setattr(_engine.HeldExperts, "_sums", lambda *a: pytest.fail("numpy"))
        x = rng.standard_normal((1, 32)).astype(np.float32)
        ids = np.array([[1, 4]])
        weights = np.array([[0.75, 0.25]], np.float32)
        want = run_experts(experts, 0, x, ids, weights, num_experts=E)
        np.testing.assert_array_equal(held(x, ids, weights), want)
        bits = x.astype(np.float16).view(np.uint16)  # half precision in and out, as bits
        want = run_experts(experts, 0, bits.view(np.float16).astype(np.float32), ids, weights,
                           num_experts=E)  # fmt: skip
        got = held(bits, ids, weights, dtype="float16")
        np.testing.assert_array_equal(got, want.astype(np.float16).view(np.uint16))
    assert loads.count([1, 4]) == 1 + 8  # held once; run_experts loads every step


def test_what_the_kernel_does_not_take_is_left_to_run_experts(tmp_path):
    """More rows for one expert than the quantized kernel takes: None, ``out`` untouched.
    Up to that count, past the kernel's rows a call, the rows run in runs: each row's bits
    as when it runs alone."""
    rng = np.random.default_rng(7)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    T = QUANT_KERNEL_MAX_ROWS + 1
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([np.full(T, 3), np.arange(T) % 3]).T.astype(np.int64)
    weights = np.full((T, 2), 0.5, np.float32)
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as pager:
        held = HeldExperts(pager, 0, num_experts=E)
        out = np.full(x.shape, 9.0, np.float32)
        assert held(x, ids, weights, out=out) is None
        assert (out == 9.0).all()
        n = QUANT_KERNEL_MAX_ROWS - 3  # expert 3: runs of 64, 64 and the rest
        assert n > 2 * _ffn.MAX_ROWS
        y = held(x[:n], ids[:n], weights[:n])
        alone = [run_experts(pager, 0, x[t : t + 1], ids[t : t + 1], weights[t : t + 1],
                             num_experts=E) for t in range(n)]  # fmt: skip
        np.testing.assert_array_equal(y, np.concatenate(alone))


def test_bad_ids_and_corrupt_blocks_are_named(tmp_path):
    rng = np.random.default_rng(8)
    path = _file(tmp_path, rng, "q4_k", "q8_0", corrupt=True)
    x = rng.standard_normal((2, H)).astype(np.float32)
    weights = np.full((2, 2), 0.5, np.float32)
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as pager:
        held = HeldExperts(pager, 0, num_experts=E)
        with pytest.raises(ValueError, match=r"expert id 6 at token 1, choice 0 is out of range"):
            held(x, np.array([[0, 1], [6, 2]]), weights)
        assert np.isfinite(held(x[:1], np.array([[0, 1]]), weights[:1])).all()
        with pytest.raises(FormatError, match=r"expert 2: its down weights hold a non-finite "
                           r"q8_0 block scale \(row 5, byte 102\)"):  # fmt: skip
            held(x, np.array([[0, 1], [1, 2]]), weights)
        with pytest.raises(ValueError, match="dtype must be one of"):
            held(x, np.array([[0, 1], [1, 2]]), weights, dtype="float64")
        with pytest.raises(ValueError, match=r"x must be a C-contiguous \[T, H\] uint16"):
            held(x, np.array([[0, 1], [1, 2]]), weights, dtype="bfloat16")


@pytest.mark.parametrize("kinds", [("q4_0", "q4_0"), ("q8_0", "q8_0")])
def test_held_before_the_first_step_reads_nothing_after(tmp_path, kinds):
    """hold(): the experts read once now (the pager counts the reads), pinned; the steps then
    load nothing, count hits only and give run_experts' bits; ids outside [0, E) are named,
    and a corrupt expert held is still named by the step that computes with it."""
    rng = np.random.default_rng(11)
    path = _file(tmp_path, rng, *kinds)
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as ours, \
            Pager(path, budget_bytes=1 << 24, page_size_kb=4) as loads:  # fmt: skip
        held = HeldExperts(ours, 0, num_experts=E)
        held.hold([4, 1, 4])
        assert sorted(ours.pinned()) == [(0, 1), (0, 4)] and ours.stats.misses == 2
        held.hold()
        assert len(ours.pinned()) == E and ours.stats.misses == E
        ours.reset_stats()
        for x, ids, weights in _steps(rng, 1):
            want = run_experts(loads, 0, x, ids, weights, num_experts=E)
            np.testing.assert_array_equal(held(x, ids, weights), want)
        assert (ours.stats.hits, ours.stats.misses) == (6 * 2, 0)
        for bad in ([E], [0, -1]):
            with pytest.raises(ValueError, match=r"hold\(\): experts \[-?\d\] outside \[0, 6\)"):
                held.hold(bad)
    path = _file(tmp_path, rng, "q4_k", "q8_0", corrupt=True)
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as pager:
        held = HeldExperts(pager, 0, num_experts=E)
        held.hold()
        x, weights = rng.standard_normal((1, H)).astype(np.float32), np.full((1, 2), 0.5)
        assert np.isfinite(held(x, np.array([[0, 1]]), weights.astype(np.float32))).all()
        with pytest.raises(FormatError, match=r"expert 2: its down weights hold a non-finite"):
            held(x, np.array([[2, 1]]), weights.astype(np.float32))


def test_reuse_checks_what_load_checks(tmp_path):
    """Pager.reuse: only experts held by live views, only while the pager is open, and a
    file changed since it was opened is an error, as load() says it."""
    rng = np.random.default_rng(9)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    pager = Pager(path, budget_bytes=1 << 24, page_size_kb=4)
    with pytest.raises(KeyError, match=r"expert \(0, 3\) is not held by live views"):
        pager.reuse(0, [3])
    batch = pager.load(0, [3])
    pager.reuse(0, [3])
    assert pager.stats.hits == 1 and pager.stats.misses == 1
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(FileChangedError, match=r"reuse\(\): weight file .* \(it was modified\)"):
        pager.reuse(0, [3])
    batch.release()
    pager.close()
    with pytest.raises(ValueError, match="this Pager is closed"):
        pager.reuse(0, [3])


@pytest.mark.parametrize("io", ["mmap", "view"])
def test_reuse_refuses_experts_read_past_their_file(tmp_path, monkeypatch, io):
    """A mapping that met the end of its file (the SIGBUS guard left zeros there): reuse()
    and reuse_many() raise FileChangedError naming the file, and serve none of it again."""
    from colibri import _guard

    rng = np.random.default_rng(10)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    pager = Pager(path, budget_bytes=1 << 24, page_size_kb=4, io=io)
    batch = pager.load(0, [3, 5])
    pager.reuse_many([(0, [3, 5])])
    monkeypatch.setattr(_guard, "faulted", lambda index: index >= 0)
    with pytest.raises(FileChangedError, match=r"reuse\(\): weight file .* shrank while it"):
        pager.reuse_many([(0, [3]), (0, [5])])
    monkeypatch.undo()
    with pytest.raises(KeyError, match=r"expert \(0, 3\) is not held"):
        pager.reuse(0, [3])
    del batch
    pager.close()


def test_reuse_many_counts_steps_in_order_or_none(tmp_path):
    """Pager.reuse_many: each step counted as reuse() counts it (hits, per layer, the trace
    in order), nothing counted when one expert is not held; a step deferred by
    HeldExperts(reused=...) is counted by the caller, not by the step."""
    rng = np.random.default_rng(12)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4, record_trace=True) as pager:
        held = HeldExperts(pager, 0, num_experts=E)
        held.hold()
        pager.reset_stats()
        x, weights = rng.standard_normal((1, H)).astype(np.float32), np.full((1, 2), 0.5)
        deferred = []
        y = held(x, np.array([[4, 1]]), weights.astype(np.float32), reused=deferred)
        assert deferred == [(0, [1, 4])] and pager.stats.hits == 0
        np.testing.assert_array_equal(y, held(x, np.array([[4, 1]]), weights.astype(np.float32)))
        assert pager.stats.hits == 2
        with pytest.raises(KeyError, match=r"expert \(1, 0\) is not held by live views"):
            pager.reuse_many([(0, [2]), (1, [0])])
        assert pager.stats.hits == 2  # none of the two counted
        pager.reuse_many([*deferred, (0, [5, 2, 5])])
        assert pager.stats.hits == 6 and pager.stats.per_layer[0].hits == 6
        assert pager.trace.steps[-3:] == [(0, (1, 4)), (0, (1, 4)), (0, (2, 5))]


def _torch_add(residual, y, dtype):
    """torch's add of two tensors of ``dtype`` given as bits (float32 as is)."""
    torch = pytest.importorskip("torch")
    if dtype == "float32":
        return (torch.from_numpy(residual) + torch.from_numpy(y)).numpy()
    t = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    a, b = (torch.from_numpy(v.copy()).view(t) for v in (residual, y))
    return (a + b).view(torch.uint16).numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("native", [True, False], ids=["quantized", "half-experts"])
def test_a_residual_is_added_as_torch_adds(tmp_path, dtype, native):
    """``residual=``: the step's result (rounded to ``dtype``) plus the residual, rounded
    again, as torch adds the two; on the native step (quantized experts) and on the numpy
    one (half-precision experts), ``out`` the residual itself too."""
    rng = np.random.default_rng(10)
    if native:
        path = _file(tmp_path, rng, "q8_0", "q8_0")
        store = Pager(path, budget_bytes=1 << 24, page_size_kb=4)
        size = H
    else:
        shapes = ((E, 64, 32), (E, 64, 32), (E, 32, 64))
        store = InMemoryExperts(*((rng.standard_normal(s) / 8).astype(np.float16)
                                  for s in shapes))  # fmt: skip
        size = 32
    held = HeldExperts(store, 0, num_experts=E)
    storage = np.float32 if dtype == "float32" else np.uint16
    for step in range(3):
        x = rng.standard_normal((2, size)).astype(np.float32) * 4
        residual = rng.standard_normal((2, size)).astype(np.float32) * 50
        if dtype != "float32":  # bits, the residual's far from the sum's scale: rounding shows
            x, residual = (_bf16(a) if dtype == "bfloat16" else
                           a.astype(np.float16).view(np.uint16) for a in (x, residual))  # fmt: skip
        ids = np.array([[1, 4], [2, -1]])
        weights = np.array([[0.75, 0.25], [1.0, 0.0]], np.float32)
        y = held(x, ids, weights, dtype=dtype)
        want = _torch_add(residual, y, dtype)
        out = residual.copy() if step else np.empty_like(residual)
        got = held(x, ids, weights, dtype=dtype, out=out, residual=out if step else residual)
        assert got is out and got.dtype == storage
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"residual must be like x"):
        held(x, ids, weights, dtype=dtype, residual=residual[:1])
    held.release()
    if native:
        store.close()


def test_the_native_steps_bad_arrays_are_named(tmp_path):
    """With every expert held and ``out=`` given (a decoding step's call), the native step
    runs first; what it refuses is named as on the checked path, and ids of another integer
    type or layout give the same bits."""
    rng = np.random.default_rng(12)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as pager:
        held = HeldExperts(pager, 0, num_experts=E)
        held.hold()
        x = _bf16(rng.standard_normal((2, H)).astype(np.float32))
        ids = np.array([[1, 4], [2, 5]])
        weights = np.array([[0.75, 0.25], [0.5, 0.5]], np.float32)
        out = np.empty_like(x)
        want = held(x, ids, weights, dtype="bfloat16").copy()
        for other in (ids.astype(np.int32), np.asfortranarray(ids)):
            got = held(x, other, weights, dtype="bfloat16", out=out)
            np.testing.assert_array_equal(got, want)
        bad = {
            r"x must be a C-contiguous \[T, H\] uint16": dict(x=x.astype(np.float32)),
            r"x must be a C-contiguous": dict(x=np.asfortranarray(x)),
            r"weights must be C-contiguous float32 or uint16": dict(weights=weights.astype(float)),
            r"out must be like x": dict(out=np.empty((2, H), np.float32)),
            r"residual must be like x": dict(residual=x[:1]),
        }
        for message, change in bad.items():
            given = dict(x=x, ids=ids, weights=weights, out=out) | change
            with pytest.raises(ValueError, match=message):
                held(given.pop("x"), given.pop("ids"), given.pop("weights"), dtype="bfloat16",
                     **given)  # fmt: skip
        with pytest.raises(ValueError, match=r"expert id 6 at token 1, choice 0 is out of range"):
            held(x, np.array([[0, 1], [6, 2]]), weights, dtype="bfloat16", out=out)
        held.release()


def test_steps_of_two_threads_on_one_layer_keep_their_own_rows(tmp_path):
    """A layer's native step keeps its plan and rows for the next step; a step of another
    thread running meanwhile (the kernel runs without the GIL) makes its own: each thread's
    sums are the ones it would get alone."""
    import threading

    rng = np.random.default_rng(13)
    path = _file(tmp_path, rng, "q8_0", "q8_0")
    with Pager(path, budget_bytes=1 << 24, page_size_kb=4) as pager:
        held = HeldExperts(pager, 0, num_experts=E, num_threads=1)
        held.hold()
        steps = [list(_steps(np.random.default_rng(s), 1 + s, count=40, k=2)) for s in (0, 1)]
        want = [[held(x, ids, w).copy() for x, ids, w in run] for run in steps]
        wrong = []

        def run(t):
            out = np.empty((1 + t, H), np.float32)
            for i, (x, ids, w) in enumerate(steps[t]):
                if not np.array_equal(held(x, ids, w, out=out), want[t][i]):
                    wrong.append((t, i))

        threads = [threading.Thread(target=run, args=(t,)) for t in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == []
        held.release()
