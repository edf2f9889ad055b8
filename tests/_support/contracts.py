"""What every fuzz target owes on hostile input, shared by the hypothesis fuzzers
(tests/test_fuzz.py) and the coverage-guided campaigns (tests/fuzz_atheris.py).

Each ``check_<target>(case)`` hands ``case`` to colibri's public parser and returns True when
colibri accepted it and the result checks out against an independent reading (json, the
safetensors library, numpy views of the same memory, a round trip), False when colibri
refused it with its documented error (``FormatError`` naming the file; ``TypeError`` /
``ValueError`` / ``BufferError`` for DLPack). Anything else raises: ``AssertionError`` for a
broken contract, or the undocumented exception itself. Files go to ``TMP`` (a fresh folder
under ``COLIBRI_FUZZ_TMP``, default the system's temporary folder), written without fsync.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import tempfile

import numpy as np
import safetensors.numpy as safetensors_numpy
import safetensors.torch as safetensors_torch
import torch

import colibri
from colibri import FormatError, Partition, UsageStats
from colibri import _json as strict
from colibri._dlpack import host_tensor
from colibri.formats import open_weights
from colibri.formats._base import DTYPE_SIZES
from colibri.formats.raw import write_experts
from colibri.pager import Trace

from .capsules import Capsule

TARGETS = ("json", "safetensors", "index", "manifest", "gguf", "partition", "stats", "trace",
           "dlpack-route", "dlpack-metadata")  # fmt: skip
TMP = tempfile.mkdtemp(prefix="colibri-fuzz-", dir=os.environ.get("COLIBRI_FUZZ_TMP"))
REFUSED = object()
EXPERT = "model.layers.{}.mlp.experts.{}.{}_proj.weight"


def path(name: str) -> str:
    return os.path.join(TMP, name)


def _write(name: str, data: bytes) -> str:
    file = path(name)
    with open(file, "wb") as f:
        f.write(data)
    return file


def attempt(call, errors=(FormatError,)):
    """``call()``, or ``REFUSED`` when it raised one of the documented ``errors``."""
    try:
        return call()
    except errors as error:
        if isinstance(error, FormatError):
            assert TMP in str(error), error  # the message names the file
        return REFUSED


# -- the strict JSON reader --------------------------------------------------------------------


def _depth(data: bytes) -> int:
    depth = best = 0
    for c in data:
        depth += (c in b"[{") - (c in b"]}")
        best = max(best, depth)
    return best


def _dup_or_constant(data: bytes) -> bool:
    found = []

    def hook(pairs):
        found.extend([1] * (len(pairs) - len(dict(pairs))))
        return dict(pairs)

    try:
        json.loads(data, object_pairs_hook=hook, parse_constant=lambda c: found.append(c))
    except (ValueError, RecursionError):
        return False
    return bool(found)


def check_json(data: bytes) -> bool:
    try:
        expected = json.loads(data.decode("utf-8"))  # bytes would also be read as UTF-16/32
    except (ValueError, RecursionError):
        expected = REFUSED
    got = attempt(lambda: strict.parse(data, path("doc.json"), what="the document"))
    if got is REFUSED:  # json refuses it too, or it repeats a key, uses NaN or nests deep
        assert expected is REFUSED or _dup_or_constant(data) or _depth(data) > 32, data
        return False
    assert expected is not REFUSED and got == expected, data
    return True


# -- safetensors headers, checked against the safetensors library ------------------------------


def check_safetensors(data: bytes) -> bool:
    source = attempt(lambda: open_weights(_write("m.safetensors", data)))
    if source is REFUSED:
        return False
    # accepted: every expert matrix is the bytes the safetensors library reads for it
    try:
        reference = safetensors_torch.load(data)  # torch: bfloat16 too
    except Exception:  # noqa: BLE001 - the library's own errors, any kind
        raise AssertionError("colibri accepted a file the safetensors library refuses") from None
    for layout in source.experts.values():
        for ref in layout.matrices:
            assert ref.offset + ref.nbytes <= len(data)
            expected = reference[ref.name]
            assert tuple(expected.shape) == ref.shape
            raw = expected.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert data[ref.offset : ref.offset + ref.nbytes] == raw
    return True


def index_shard() -> str:
    shard = path("s.safetensors")
    if not os.path.exists(shard):
        safetensors_numpy.save_file(
            {EXPERT.format(0, 0, p): np.ones((2, 2), np.float16) for p in ("gate", "up", "down")},
            shard,
        )
    return shard


def check_index(data: bytes) -> bool:
    shard = index_shard()
    file = _write("m.safetensors.index.json", data)
    source = attempt(lambda: open_weights(file), errors=(FormatError, FileNotFoundError))
    if source is REFUSED:
        return False
    assert source.files == (shard,)
    return True


# -- colibri raw manifests ---------------------------------------------------------------------


def raw_manifest() -> tuple[str, dict]:
    """The raw file every manifest case points at, and its valid manifest."""
    file = path("x.colibri")
    if not os.path.exists(file):
        gate, down = np.ones((2, 3), np.float16), np.ones((3, 2), np.float16)
        experts = {(lay, e): (gate * e, gate, down) for lay in range(2) for e in range(2)}
        write_experts(file, experts, alignment=64, metadata={"groups": {"0": [[0], [1]]}})
    with open(file + ".json") as f:
        return file, json.load(f)


def check_manifest(data: bytes) -> bool:
    file, _ = raw_manifest()
    mpath = _write("y.colibri.json", data)
    source = attempt(lambda: open_weights(mpath), errors=(FormatError, FileNotFoundError))
    if source is REFUSED:
        return False
    size = os.path.getsize(file)
    spans = []
    for layout in source.experts.values():
        for ref in layout.matrices:
            width = DTYPE_SIZES.get(ref.dtype)
            assert width is None or ref.nbytes == math.prod(ref.shape) * width
            assert ref.offset >= 0 and ref.offset + ref.nbytes <= size
            spans.append((ref.offset, ref.offset + ref.nbytes))
    spans = sorted(s for s in spans if s[0] != s[1])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlaps
    return True


# -- GGUF, through the gguf package ------------------------------------------------------------


def gguf_bytes() -> bytes:
    """A valid GGUF file of stacked experts (the seed that cases mutate)."""
    import gguf

    file = path("m.gguf")
    if not os.path.exists(file):
        w = gguf.GGUFWriter(file, "llama")
        w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((2, 3, 4), np.float32))
        w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((2, 3, 4), np.float32))
        w.add_tensor("blk.0.ffn_down_exps.weight", np.ones((2, 4, 3), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    with open(file, "rb") as f:
        return f.read()


def check_gguf(data: bytes) -> bool:
    source = attempt(lambda: open_weights(_write("f.gguf", data)))
    if source is REFUSED:
        return False
    for layout in source.experts.values():
        for ref in layout.matrices:
            assert ref.offset + ref.nbytes <= len(data)
    return True


# -- partitions, usage statistics, traces: refused, or a value that round-trips ------------------


def check_partition(data: bytes) -> bool:
    partition = attempt(lambda: Partition.load(_write("p.json", data)))
    if partition is REFUSED:
        return False
    flat = sorted(e for g in partition.groups for e in g)
    assert flat == list(range(partition.num_experts))  # every expert exactly once
    partition.save(path("p2.json"), overwrite=True)
    assert Partition.load(path("p2.json")) == partition
    return True


@functools.cache
def stats_seeds() -> dict[str, bytes]:
    """Valid saved statistics, ``{suffix: bytes}``."""
    out = {}
    for suffix in (".json", ".npz"):
        UsageStats.from_ids([[0, 1], [1, 2], [2, 0]], 3).save(path("u0" + suffix), overwrite=True)
        with open(path("u0" + suffix), "rb") as f:
            out[suffix] = f.read()
    return out


def check_stats(case: tuple[str, bytes]) -> bool:
    suffix, data = case
    stats = attempt(lambda: UsageStats.load(_write("u" + suffix, data)))
    if stats is REFUSED:
        return False
    co = stats.coactivation
    assert (co == co.T).all() and (np.diagonal(co) == stats.counts).all()
    assert stats.counts.max(initial=0) <= stats.tokens
    stats.save(path("u2" + suffix), overwrite=True)
    assert UsageStats.load(path("u2" + suffix)) == stats
    return True


def check_trace(data: bytes) -> bool:
    trace = attempt(lambda: Trace.load(_write("t.json", data)))
    if trace is REFUSED:
        return False
    for layer, ids in trace.steps:
        assert type(layer) is int and layer >= 0
        assert all(type(e) is int and 0 <= e < 1 << 31 for e in ids)
    return True


# -- DLPack intake: hand-made capsules ----------------------------------------------------------

E_ROUTE = 8
_RNG = np.random.default_rng(3)
BASES = {
    dtype: (_RNG.standard_normal(600) * 4).astype(dtype)
    for dtype in (np.float32, np.float64, np.float16)
}
_CONTEXTS = {}


def _context(k: int):
    if k not in _CONTEXTS:
        _CONTEXTS[k] = colibri.init(E_ROUTE, k)
    return _CONTEXTS[k]


def extent(shape, strides) -> tuple[int, int]:
    """Lowest and highest element index (relative to the first) that ``shape`` and element
    ``strides`` (None: C order) reach."""
    steps = strides or [E_ROUTE, 1][-len(shape) :]
    low = sum(min(0, s * (d - 1)) for s, d in zip(steps, shape, strict=True) if d)
    high = sum(max(0, s * (d - 1)) for s, d in zip(steps, shape, strict=True) if d)
    return low, high


def check_route(case) -> bool:
    """``case``: dtype, shape, element strides, element offset, versioned, flags, k, whose
    elements all lie inside the base array: colibri must read exactly what numpy reads."""
    dtype, shape, strides, offset, versioned, flags, k = case
    base = BASES[dtype]
    itemsize = base.itemsize
    cap = Capsule(base, shape=shape, strides=strides, byte_offset=offset * itemsize,
                  versioned=versioned, flags=flags)  # fmt: skip
    view = np.ndarray(  # numpy checks that the geometry stays inside base
        shape, dtype, buffer=base, offset=offset * itemsize,
        strides=None if strides is None else [s * itemsize for s in strides],
    )  # fmt: skip
    ctx = _context(k)
    ids, weights = ctx.route(cap.capsule)
    ref_ids, ref_weights = ctx.route(np.ascontiguousarray(view))
    assert ids.shape == ref_ids.shape == (*shape[:-1], k)
    assert ((ids >= 0) & (ids < E_ROUTE)).all()  # never an out-of-range expert id
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(weights, ref_weights)
    assert cap.deleted == 1  # freed by reference counting (no gc.collect: slow in a big heap)
    return True


DLPACK_ERRORS = (TypeError, ValueError, BufferError)


def check_metadata(fields: dict) -> bool:
    """Metadata only: colibri must validate it without reading a byte of the tensor."""
    cap = Capsule(BASES[np.float32], **fields)
    tensor = attempt(lambda: host_tensor(cap.capsule), errors=DLPACK_ERRORS)
    accepted = tensor is not REFUSED
    if accepted:
        assert tensor.shape == tuple(fields["shape"])
        if fields["strides"] is not None and math.prod(fields["shape"]):
            assert tensor.strides == tuple(fields["strides"])
        shape = tensor.shape
        if len(shape) not in (1, 2) or shape[-1] != E_ROUTE or not math.prod(shape):
            # route() must refuse it before reading (or route nothing: T = 0)
            routed = attempt(lambda: _context(2).route(tensor), errors=DLPACK_ERRORS)
            assert routed is REFUSED or math.prod(shape) == 0
        del tensor
    assert cap.deleted == 1  # consumed exactly once, whatever happened
    return accepted


CHECKS = {
    "json": check_json, "safetensors": check_safetensors, "index": check_index,
    "manifest": check_manifest, "gguf": check_gguf, "partition": check_partition,
    "stats": check_stats, "trace": check_trace, "dlpack-route": check_route,
    "dlpack-metadata": check_metadata,
}  # fmt: skip


def safetensors_file(header: dict, data_len: int, pad: int = 0) -> bytes:
    """A safetensors file: ``header`` as JSON (``pad`` spaces after), then ``data_len`` bytes."""
    blob = json.dumps(header).encode() + b" " * pad
    return (struct.pack("<Q", len(blob)) + blob + bytes(range(256)) * 2)[: 8 + len(blob) + data_len]
