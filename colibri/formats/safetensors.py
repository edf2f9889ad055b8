"""safetensors headers (single files and sharded checkpoints with an index JSON).

The safetensors Python API exposes no byte offsets, so the header is parsed here: an 8-byte
little-endian length ``N``, then ``N`` bytes of JSON mapping each tensor name to its ``dtype``,
``shape`` and ``data_offsets`` (relative to the end of the header). Everything is validated
before the source is returned; the file is only read, never mapped, and only if it is a
regular file (a FIFO, device or directory under a shard's name is refused by its type).
"""

from __future__ import annotations

import os
import struct

from colibri import _json
from colibri._regular import open_regular, read_regular
from colibri.formats._base import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    FormatError,
    TensorInfo,
    WeightSource,
    assemble_experts,
    check_extents,
)

__all__ = [
    "QUANTIZATION_KEY",
    "QUANTIZED_BLOCKS",
    "expert_source",
    "open_safetensors",
    "open_sharded",
    "read_header",
]

#: The ``__metadata__`` key of a file ``colibri quantize`` wrote: a JSON object (as a string,
#: the only value type the header allows) mapping each block-quantized tensor to its type
#: (``"q4_k"``, ...). Such a tensor is stored as ``U8 [..., rows, row_bytes]``: every row its
#: GGUF blocks; it is read as that type with the logical shape ``[..., rows, values]``.
QUANTIZATION_KEY = "colibri_quantization"
#: The block types colibri computes (include/colibri/quant.h; a test holds this table equal to
#: ``colibri.layer``'s): values and bytes per block.
QUANTIZED_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_k": (256, 144), "q5_k": (256, 176),
                    "q6_k": (256, 210), "iq4_xs": (256, 136), "mxfp4": (32, 17)}  # fmt: skip


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header.

    Returns
    -------
    dict
        tensor name -> :class:`TensorInfo` with absolute offsets.

    Raises
    ------
    FormatError
        naming ``path`` and the tensor when the header is truncated, too large, not JSON, or
        describes ranges outside the file, overlapping ranges, or wrong lengths; or ``path``
        is no regular file (:class:`colibri._regular.CheckpointError`).
    FileNotFoundError
        ``path`` does not exist.
    """
    with open_regular(path, "the safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise FormatError(f"{path}: {size} bytes is too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise FormatError(
                f"{path}: header claims {length} bytes, more than the {MAX_HEADER_BYTES} allowed; "
                "the file is corrupt or not safetensors"
            )
        if 8 + length > size:
            raise FormatError(
                f"{path}: header claims {length} bytes but the file has only {size - 8} after "
                "the length prefix; the file is truncated"
            )
        raw = f.read(length)
    if len(raw) != length:
        raise FormatError(f"{path}: the file shrank while its header was read")
    header = _json.mapping(
        _json.parse(raw, path, what="the safetensors header"), path, "the safetensors header"
    )
    start = 8 + length
    tensors = {}
    metadata: dict[str, str] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            metadata = _json.mapping(entry, path, name)
            for key, value in metadata.items():
                _json.string(value, path, f"__metadata__.{key}")
            continue
        entry = _json.mapping(entry, path, name)
        dtype = _json.string(_json.field(entry, "dtype", path, f"{name}."), path, f"{name}.dtype")
        if dtype not in DTYPE_SIZES:
            raise FormatError(
                f"{path}: {name + '.dtype'!r} must be one of {', '.join(DTYPE_SIZES)} "
                f"(got {_json.show(dtype)})"
            )
        shape = _json.int_list(
            _json.field(entry, "shape", path, f"{name}."), path, f"{name}.shape", max_len=64
        )
        begin, end = _json.int_list(
            _json.field(entry, "data_offsets", path, f"{name}."), path, f"{name}.data_offsets",
            min_len=2, max_len=2,
        )  # fmt: skip
        if end < begin or end > size - start:
            raise FormatError(
                f"{path}: {name + '.data_offsets'!r} must be [begin, end] inside the data section "
                f"[0, {size - start}], begin <= end (got {[begin, end]}); the file is truncated "
                "or its header is corrupt"
            )
        tensors[name] = TensorInfo(name, path, start + begin, end - begin, dtype, tuple(shape))
    covered = 0  # the format forbids holes (no polyglot files): tensors tile the data section
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.offset - start != covered:
            break
        covered += t.nbytes
    if covered != size - start:
        raise FormatError(
            f"{path}: the tensors' data_offsets must tile the data section [0, {size - start}) "
            f"without holes or overlaps, as the safetensors format requires (they cover [0, "
            f"{covered}) then leave a gap or overlap); the file is truncated or corrupt"
        )
    if QUANTIZATION_KEY in metadata:
        _read_quantized(path, tensors, metadata[QUANTIZATION_KEY])
    check_extents(path, size, start, tensors.values())
    return tensors


def _read_quantized(path: str, tensors: dict[str, TensorInfo], types: str) -> None:
    """Give each tensor the :data:`QUANTIZATION_KEY` entry ``types`` names its block type
    and logical shape (in place), after checking it is ``U8`` rows of whole blocks."""
    where = f"__metadata__.{QUANTIZATION_KEY}"
    types = _json.mapping(_json.parse(types.encode(), path, what=where), path, where)
    for name, qtype in types.items():
        qtype = _json.string(qtype, path, f"{where}.{name}")
        if qtype not in QUANTIZED_BLOCKS:
            raise FormatError(
                f"{path}: {where} gives tensor {name!r} the type {_json.show(qtype)}; colibri "
                f"computes {', '.join(QUANTIZED_BLOCKS)}"
            )
        t = tensors.get(name)
        if t is None:
            raise FormatError(f"{path}: {where} names tensor {name!r}, which the file lacks")
        values, size = QUANTIZED_BLOCKS[qtype]
        if t.dtype != "U8" or len(t.shape) < 2 or not t.shape[-1] or t.shape[-1] % size:
            raise FormatError(
                f"{path}: tensor {name!r} is {qtype} by {where}, so it must be U8 [..., rows, "
                f"row_bytes] with row_bytes a positive multiple of {size} (whole blocks) (got "
                f"{t.dtype} {list(t.shape)}); the file is corrupt"
            )
        shape = (*t.shape[:-1], t.shape[-1] // size * values)
        tensors[name] = TensorInfo(name, t.path, t.offset, t.nbytes, qtype.upper(), shape,
                                   (values, size))  # fmt: skip


def expert_source(path: str, tensors: dict[str, TensorInfo]) -> WeightSource:
    """The routed experts among ``tensors`` (headers already read and checked, of one file
    or of a sharded checkpoint whose index is ``path``) as a :class:`WeightSource`; no file
    is opened.

    Raises
    ------
    FormatError
        An expert lacks a matrix, has two, or its shapes disagree (naming ``path``).
    """
    experts = assemble_experts(path, tensors)
    files = tuple(sorted({ref.path for layout in experts.values() for ref in layout.matrices}))
    return WeightSource("safetensors", files, experts)


def open_safetensors(path: str | os.PathLike) -> WeightSource:
    """Open one ``.safetensors`` file as a :class:`WeightSource`."""
    path = os.path.abspath(os.fspath(path))
    tensors = read_header(path)
    experts = assemble_experts(path, tensors)
    if not experts:
        raise FormatError(
            f"{path}: no routed-expert tensors found (names like "
            "'model.layers.0.mlp.experts.0.gate_proj.weight' or "
            "'model.layers.0.mlp.experts.gate_up_proj')"
        )
    return WeightSource("safetensors", (path,), experts)


def open_sharded(index_path: str | os.PathLike) -> WeightSource:
    """Open a sharded checkpoint from its ``*.safetensors.index.json``.

    Every shard named in ``weight_map`` must sit in the index's directory (no absolute paths,
    no ``..``) and hold the tensors the index assigns to it.
    """
    index_path = os.path.abspath(os.fspath(index_path))
    folder = os.path.dirname(index_path)
    data = read_regular(index_path, "the index", _json.MAX_BYTES)
    index = _json.mapping(_json.parse(data, index_path, what="the index"), index_path, "the index")
    weight_map = _json.mapping(
        _json.field(index, "weight_map", index_path), index_path, "weight_map"
    )
    if not weight_map:
        raise FormatError(f"{index_path}: 'weight_map' must name at least one tensor (got {{}})")
    if "metadata" in index:
        _json.mapping(index["metadata"], index_path, "metadata")
    shards: dict[str, dict[str, TensorInfo]] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or shard in ("", ".", "..")
            or any(c in shard for c in "/\\\0")
            or os.path.isabs(shard)
        ):
            raise FormatError(
                f"{index_path}: {'weight_map.' + name!r} must be a plain file name in the "
                f"index's folder (got {_json.show(shard)})"
            )
        if shard not in shards:
            shards[shard] = read_header(os.path.join(folder, shard))
        if name not in shards[shard]:
            raise FormatError(
                f"{index_path}: tensor {name!r} is assigned to {shard!r}, which does not hold it"
            )
        tensors[name] = shards[shard][name]
    experts = assemble_experts(index_path, tensors)
    if not experts:
        raise FormatError(f"{index_path}: no routed-expert tensors found")
    files = tuple(sorted({os.path.join(folder, s) for s in shards}))
    return WeightSource("safetensors", files, experts)
