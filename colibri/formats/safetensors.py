"""safetensors headers (single files and sharded checkpoints with an index JSON).

The safetensors Python API exposes no byte offsets, so the header is parsed here: an 8-byte
little-endian length ``N``, then ``N`` bytes of JSON mapping each tensor name to its ``dtype``,
``shape`` and ``data_offsets`` (relative to the end of the header). Everything is validated
before the source is returned; the file is only read, never mapped.
"""

from __future__ import annotations

import json
import os
import struct

from colibri.formats._base import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    FormatError,
    TensorInfo,
    WeightSource,
    assemble_experts,
    check_extents,
    file_size,
)

__all__ = ["open_safetensors", "open_sharded", "read_header"]


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
        describes ranges outside the file, overlapping ranges, or wrong lengths.
    """
    size = file_size(path)
    with open(path, "rb") as f:
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
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: the safetensors header must be a JSON object")
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise FormatError(f"{path}: tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise FormatError(
                f"{path}: tensor {name!r} has unknown dtype {dtype!r} "
                f"(known: {', '.join(DTYPE_SIZES)})"
            )
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]
        ):
            raise FormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
        tensors[name] = TensorInfo(
            name, path, start + offsets[0], offsets[1] - offsets[0], dtype, tuple(shape)
        )
    check_extents(path, size, start, tensors.values())
    return tensors


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
    if file_size(index_path) > MAX_HEADER_BYTES:
        raise FormatError(f"{index_path}: index larger than {MAX_HEADER_BYTES} bytes")
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{index_path}: the index is not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index_path}: the index has no 'weight_map' object")
    shards: dict[str, dict[str, TensorInfo]] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or os.path.isabs(shard)
            or os.path.normpath(shard).startswith("..")
            or os.path.dirname(os.path.normpath(shard))
        ):
            raise FormatError(
                f"{index_path}: tensor {name!r} points to {shard!r}; shards must be plain file "
                "names in the index's folder"
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
