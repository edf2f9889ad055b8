"""DLPack intake: producers, capsules, strides, dtypes, ownership and the caller's framework."""

import gc
import sys

import numpy as np
import pytest

import colibri
from _support import reference as ref
from _support.capsules import Capsule, Producer
from colibri._dlpack import host_tensor, import_host


@pytest.fixture(scope="module")
def torch():
    """torch, for the tests that take it (the others run without it)."""
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def jax():
    """jax, for the tests that take it (the others run without it)."""
    return pytest.importorskip("jax")


def expected(x, k=3, **options):
    ids, w, _ = ref.route(np.asarray(x, np.float32), k, **options)
    return ids, w


def assert_route(got, x, k=3, **options):
    ids, w = (np.asarray(a) for a in got)
    ref_ids, ref_w = expected(x, k, **options)
    np.testing.assert_array_equal(ids.reshape(ref_ids.shape), ref_ids)
    np.testing.assert_allclose(w.reshape(ref_w.shape), ref_w, rtol=2e-6, atol=1e-7)


@pytest.fixture
def logits():
    return np.random.default_rng(0).standard_normal((9, 12)).astype(np.float32)


def test_torch_in_torch_out(torch, logits):
    t = torch.from_numpy(logits)
    ids, w = colibri.init(12, 3).route(t)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
    assert_route((ids, w), logits)


def test_jax_in_jax_out(jax, logits):
    ids, w = colibri.init(12, 3).route(jax.numpy.asarray(logits))
    assert isinstance(ids, jax.Array) and isinstance(w, jax.Array)
    assert ids.dtype == jax.numpy.int32
    assert_route((ids, w), logits)


@pytest.mark.parametrize(
    "view", ["transpose", "slice", "step", "column_major", "broadcast", "reverse"]
)
def test_strided_views(view, logits):
    base = np.random.default_rng(1).standard_normal((24, 30)).astype(np.float32)
    x = {
        "transpose": base[:12, :9].T,
        "slice": base[3:12, 5:17],
        "step": base[::2, ::2][:9, :12],
        "column_major": np.asfortranarray(logits),
        "broadcast": np.broadcast_to(logits[4], (9, 12)),
        "reverse": base[::-1, ::-1][:9, :12],
    }[view]
    ctx = colibri.init(12, 3)
    assert_route(ctx.route(x), x)  # numpy: buffer protocol
    assert_route(ctx.route(Producer(x)), x)  # generic DLPack producer: capsule path
    if view != "reverse":  # torch has no negative strides
        torch = pytest.importorskip("torch")
        assert_route(
            ctx.route(
                torch.from_numpy(np.require(x, requirements="W") if view == "broadcast" else x)
            ),
            x,
        )


def test_jax_transposed(jax, logits):
    x = jax.numpy.asarray(logits.T.copy()).T  # a transposed jax array
    assert_route(colibri.init(12, 3).route(x), logits)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")  # jax x32
def test_low_and_high_precision_inputs(torch, jax, dtype, logits):
    t = torch.from_numpy(logits).to(getattr(torch, dtype))
    decoded = t.to(torch.float32).numpy()
    assert_route(colibri.init(12, 3).route(t), decoded)
    assert_route(colibri.init(12, 3).route(t.T.contiguous().T), decoded)
    j = jax.numpy.asarray(decoded).astype(dtype)
    assert_route(colibri.init(12, 3).route(j), np.asarray(j.astype(jax.numpy.float32)))


def test_float16_numpy_and_special_values(torch):
    x = np.array([[65504, -65504, np.inf, 6e-8, 0, -0.0, 1, 2]], np.float16)
    t = host_tensor(x)
    assert t.dtype == "float16"
    assert_route(colibri.init(8, 3).route(x), x.astype(np.float32))
    bits = np.array([0x7F80, 0xFF80, 0x0001, 0x3F80, 0xC000, 0x0000, 0x8000, 0x4049], np.uint16)
    bf = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)[None]
    assert_route(colibri.init(8, 3).route(bf), bf.float().numpy())


@pytest.mark.parametrize("versioned", [True, False])
def test_raw_capsules_of_both_kinds(versioned, logits):
    cap = logits.__dlpack__(max_version=(1, 0) if versioned else None)
    name = "dltensor_versioned" if versioned else "dltensor"
    assert name in repr(cap)
    ids, w = colibri.init(12, 3).route(cap)
    assert type(ids) is np.ndarray  # a raw capsule gives numpy out
    assert_route((ids, w), logits)
    assert "used_" + name in repr(cap)
    with pytest.raises(ValueError, match="already consumed"):
        colibri.init(12, 3).route(cap)


def test_torch_legacy_capsule(torch, logits):
    from torch.utils.dlpack import to_dlpack

    assert_route(colibri.init(12, 3).route(to_dlpack(torch.from_numpy(logits))), logits)


def test_older_producer_without_keywords(logits):
    producer = Producer(logits, legacy_only=True)
    assert_route(colibri.init(12, 3).route(producer), logits)
    assert producer.calls == [(1, 1), None]


@pytest.mark.parametrize("versioned", [True, False])
def test_deleter_called_exactly_once(versioned, logits):
    cap = Capsule(logits, shape=logits.shape, versioned=versioned)
    colibri.init(12, 3).route(cap.capsule)
    gc.collect()
    assert cap.deleted == 1
    cap = Capsule(logits, shape=logits.shape, versioned=versioned)
    tensor = host_tensor(cap.capsule)
    assert cap.deleted == 0  # the imported tensor owns it now
    del tensor
    gc.collect()
    assert cap.deleted == 1


def test_deleter_runs_when_view_dies(logits):
    cap = Capsule(logits, shape=logits.shape)
    array, dtype = import_host(cap.capsule)
    assert dtype == "float32" and cap.deleted == 0
    np.testing.assert_array_equal(array, logits)
    del array
    gc.collect()
    assert cap.deleted == 1


def test_null_strides_byte_offset_and_unaligned():
    raw = np.random.default_rng(5).standard_normal(200).astype(np.float32)
    x = raw[3 : 3 + 8 * 12].reshape(8, 12)
    cap = Capsule(raw, shape=(8, 12), strides=None, byte_offset=12)  # NULL strides, offset 3
    assert_route(colibri.init(12, 3).route(cap.capsule), x)
    buf = np.zeros(8 * 12 * 4 + 1, np.uint8)  # float32 data at an odd address
    odd = np.frombuffer(buf.data, dtype=np.float32, count=96, offset=1).reshape(8, 12)
    assert odd.ctypes.data % 4 == 1  # numpy allocations are at least 16-byte aligned
    assert_route(colibri.init(12, 3).route(Producer(odd)), odd)


def test_size_one_dims_with_arbitrary_strides():
    x = np.random.default_rng(2).standard_normal((1, 12)).astype(np.float32)
    cap = Capsule(x, shape=(1, 12), strides=(987654, 1))
    assert_route(colibri.init(12, 3).route(cap.capsule), x)


def test_zero_strides_and_empty():
    row = np.random.default_rng(3).standard_normal(12).astype(np.float32)
    cap = Capsule(row, shape=(4, 12), strides=(0, 1))
    assert_route(colibri.init(12, 3).route(cap.capsule), np.broadcast_to(row, (4, 12)))
    empty = Capsule(np.zeros(1, np.float32), shape=(0, 12), null_data=True)
    ids, w = colibri.init(12, 3).route(empty.capsule)
    assert ids.shape == (0, 3)


def test_read_only_input_is_never_written(logits):
    x = logits.copy()
    x.setflags(write=False)
    before = x.copy()
    colibri.init(12, 3).route(x)
    np.testing.assert_array_equal(x, before)
    cap = Capsule(x, shape=x.shape, flags=1)  # READ_ONLY
    assert host_tensor(cap.capsule).readonly
    assert_route(colibri.init(12, 3).route(Capsule(x, shape=x.shape, flags=1).capsule), x)


def test_cuda_host_device_is_read(logits):
    cap = Capsule(logits, shape=logits.shape, device=(3, 0))  # kDLCUDAHost (pinned)
    assert_route(colibri.init(12, 3).route(cap.capsule), logits)


def test_device_tensor_without_host_copy_is_refused(logits):
    cap = Capsule(logits, shape=logits.shape, device=(2, 0))
    with pytest.raises(BufferError, match=r"cuda:0.*\.cpu\(\)"):
        colibri.init(12, 3).route(cap.capsule)
    gc.collect()
    assert cap.deleted == 1


def test_unsupported_version_calls_deleter(logits):
    cap = Capsule(logits, shape=logits.shape, version=(2, 0))
    with pytest.raises(BufferError, match="version 2.0"):
        colibri.init(12, 3).route(cap.capsule)
    gc.collect()
    assert cap.deleted == 1


def refusal(named: str) -> str:
    """A TypeError message from route() that names the dtype and lists the ones it reads."""
    return rf"^route\(logits\): (?=.*{named})(?=.*float32, float64, float16 (and|or) bfloat16)"


@pytest.mark.parametrize(
    ("code", "bits", "named"),
    [
        (0, 32, r"got int32"),
        (6, 8, r"got bool"),
        (1, 16, r"got uint16"),
        (5, 64, r"unsupported dtype complex64"),
        (7, 8, r"DLPack code 7\b"),  # fp8: a code colibri has no name for
    ],
    ids=["int32", "bool", "uint16", "complex64", "fp8"],
)
def test_non_float_capsule_dtypes_refused(code, bits, named):
    """A capsule of a non-float dtype is refused by name, and the message lists what is read;
    the capsule is consumed and released once all the same."""
    cap = Capsule(np.zeros(64, np.float32), shape=(2, 12), dtype=(code, bits))
    with pytest.raises(TypeError, match=refusal(named)):
        colibri.init(12, 3).route(cap.capsule)
    gc.collect()
    assert cap.deleted == 1


@pytest.mark.parametrize(
    ("dtype", "named"),
    [
        (np.int32, r"got int32"),
        (np.bool_, r"got bool"),
        (np.uint8, r"got uint8"),
        (np.complex64, r"buffer format 'Zf'"),
    ],
    ids=["int32", "bool", "uint8", "complex64"],
)
def test_non_float_numpy_dtypes_refused(dtype, named):
    with pytest.raises(TypeError, match=refusal(named)):
        colibri.init(12, 3).route(np.zeros((2, 12), dtype))


def test_requires_grad_is_refused_with_the_fix(torch):
    t = torch.randn(3, 12, requires_grad=True)
    with pytest.raises(ValueError, match=r"detach\(\)"):
        colibri.init(12, 3).route(t)
    colibri.init(12, 3).route(t.detach())
    with torch.no_grad():
        colibri.init(12, 3).route(t * 1)


def test_out_buffers_any_producer(torch, logits):
    ctx = colibri.init(12, 3)
    ids, w = np.empty((9, 3), np.int32), np.empty((9, 3), np.float32)
    got = ctx.route(logits, out=(ids, w))
    assert got[0] is ids and got[1] is w
    assert_route((ids, w), logits)
    tids, tw = torch.empty(9, 3, dtype=torch.int32), torch.empty(9, 3)
    ctx.route(torch.from_numpy(logits), out=(tids, tw))
    assert_route((tids, tw), logits)
    big_ids, big_w = np.zeros((9, 6), np.int32), np.zeros((9, 6), np.float32)
    ctx.route(logits, out=(big_ids[:, ::2], big_w[:, 1::2]))  # strided out views
    assert_route((big_ids[:, ::2], big_w[:, 1::2]), logits)
    assert (big_ids[:, 1::2] == 0).all() and (big_w[:, ::2] == 0).all()


def test_out_buffer_errors(logits):
    ctx = colibri.init(12, 3)
    ok_ids, ok_w = ctx.buffers(9)
    with pytest.raises(ValueError, match="shape"):
        ctx.route(logits, out=(np.empty((9, 2), np.int32), ok_w))
    with pytest.raises(TypeError, match="int32"):
        ctx.route(logits, out=(np.empty((9, 3), np.int64), ok_w))
    with pytest.raises(TypeError, match="float32"):
        ctx.route(logits, out=(ok_ids, np.empty((9, 3), np.float64)))
    ro = np.empty((9, 3), np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        ctx.route(logits, out=(ok_ids, ro))
    with pytest.raises(TypeError, match="tuple"):
        ctx.route(logits, out=[ok_ids, ok_w])
    one_row = np.zeros(3, np.float32)
    stuck = np.lib.stride_tricks.as_strided(one_row, shape=(9, 3), strides=(0, 4))
    with pytest.raises(ValueError, match="zero stride"):
        ctx.route(logits, out=(ok_ids, stuck))
    both = np.empty((9, 3), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        ctx.route(logits, out=(both.view(np.int32), both))
    scratch = np.zeros((9, 15), np.float32)
    scratch[:, :12] = logits
    with pytest.raises(ValueError, match="overlaps the logits"):
        ctx.route(scratch[:, :12], out=(ok_ids, scratch[:, 12:]))


def test_no_refcount_or_memory_leak(torch):
    import tracemalloc

    x = np.random.default_rng(0).standard_normal((4, 26)).astype(np.float32)
    t = torch.from_numpy(x)
    ctx = colibri.init(26, 2)
    ids, w = ctx.buffers(4)
    for _ in range(1000):  # warm caches
        ctx.route(x), ctx.route(t), ctx.route(x[0], out=(ids[0], w[0]))
    refs = [sys.getrefcount(o) for o in (x, t, ids, w, ctx)]
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    for _ in range(100_000):
        ctx.route(x[0], out=(ids[0], w[0]))
    for _ in range(20_000):
        ctx.route(x)
        ctx.route(t)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename"))
    tracemalloc.stop()
    assert grown < 64 * 1024, f"traced memory grew by {grown} bytes"
    assert [sys.getrefcount(o) for o in (x, t, ids, w, ctx)] == refs


def test_one_context_from_four_threads():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(9)
    batches = [
        rng.standard_normal((int(n), 64)).astype(np.float32) for n in rng.integers(1, 3000, 40)
    ]
    ctx = colibri.init(
        64,
        4,
        scoring="sigmoid",
        num_groups=8,
        topk_groups=3,
        correction_bias=rng.standard_normal(64).astype(np.float32),
        collect_stats=True,
    )
    serial = [ctx.route(b) for b in batches]
    ctx.reset_stats()
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(ctx.route, batches))
    for (i1, w1), (i2, w2) in zip(serial, parallel, strict=True):
        assert np.array_equal(i1, i2) and np.array_equal(w1, w2)
    stats = ctx.stats
    assert stats.tokens == sum(len(b) for b in batches)
    all_ids = np.concatenate([i for i, _ in serial])
    np.testing.assert_array_equal(stats.counts, np.bincount(all_ids.ravel(), minlength=64))
    expected = colibri.UsageStats.from_ids(all_ids, 64)  # every pair, counted once
    np.testing.assert_array_equal(stats.coactivation, expected.coactivation)


class DeviceProducer(Producer):
    """Reports a CUDA tensor; copies to the host only when asked with dl_device + copy."""

    def __init__(self, array, *, can_copy):
        super().__init__(array)
        self.can_copy = can_copy

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append((dl_device, copy))
        if dl_device != (1, 0) or not copy or not self.can_copy:
            raise BufferError("cannot export a device tensor to this device")
        return self.array.copy().__dlpack__(max_version=max_version)


def test_device_tensor_is_copied_through_the_producer(logits):
    producer = DeviceProducer(logits, can_copy=True)
    assert_route(colibri.init(12, 3).route(producer), logits)
    assert producer.calls == [((1, 0), True)]
    with pytest.raises(BufferError, match=r"lives on cuda.*\.cpu\(\)"):
        colibri.init(12, 3).route(DeviceProducer(logits, can_copy=False))


def test_out_buffers_on_a_device_or_copied_are_refused(logits):
    """Results written into a host copy of a device buffer would be lost: refuse them."""
    ctx = colibri.init(12, 3)
    ids, w = ctx.buffers(9)
    device_w = DeviceProducer(np.zeros((9, 3), np.float32), can_copy=True)
    with pytest.raises(BufferError, match=r"lives on cuda.*device='cpu'"):
        ctx.route(logits, out=(ids, device_w))
    assert device_w.calls == []  # not even asked for a copy
    copied = Capsule(np.zeros((9, 3), np.float32), shape=(9, 3), flags=2)  # IS_COPIED
    with pytest.raises(BufferError, match="IS_COPIED"):
        ctx.route(logits, out=(ids, copied.capsule))
    assert_route(ctx.route(logits, out=(ids, w)), logits)


def _numpy_cases():
    base = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4)
    for dtype in (
        np.float16,
        np.float32,
        np.float64,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.intc,
        np.longlong,
        np.uint8,
        np.uint16,
        np.bool_,
    ):
        x = base.astype(dtype)
        yield x
        yield x[:, ::-2, 1:]  # negative and skipping strides
        yield x.transpose(2, 0, 1)
        yield np.broadcast_to(x[:1], (5, 3, 4))  # zero strides, read-only
        yield x[:0]
        yield np.asarray(x[0, 0, 0])  # 0-d
    ro = base.astype(np.float32)
    ro.flags.writeable = False
    yield ro


@pytest.mark.parametrize("x", list(_numpy_cases()), ids=lambda x: f"{x.dtype}{x.strides}")
def test_numpy_intake_matches_the_buffer_protocol(x):
    """numpy arrays are read from numpy's struct: the same view the buffer protocol gives."""
    t = host_tensor(x)
    m = memoryview(x)
    assert t.shape == m.shape and t.readonly == m.readonly
    assert t.strides == tuple(s // x.itemsize for s in m.strides)
    assert t.address == x.__array_interface__["data"][0]
    assert t.dtype == x.dtype.name
    np.testing.assert_array_equal(t.numpy().view(x.dtype), x)
    if not m.readonly:
        host_tensor(x, writable=True)
    else:
        with pytest.raises(ValueError, match="read-only"):
            host_tensor(x, writable=True)


@pytest.mark.parametrize(
    "x",
    [
        np.zeros(4, ">f4"),
        np.zeros(4, np.complex64),
        np.zeros(4, np.float128) if hasattr(np, "float128") else np.zeros(4, np.uint32),
        np.zeros(4, "U2"),
    ],
    ids=lambda x: x.dtype.str,
)
def test_numpy_arrays_colibri_cannot_read_are_refused(x):
    with pytest.raises(TypeError):
        colibri.init(4, 2).route(x)
