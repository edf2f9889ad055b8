"""GGUF files through the ``gguf`` package (extra ``formats``).

``gguf.GGUFReader`` is the package's only parser and reads the header through a read-only
``np.memmap`` of the file. colibri takes the tensor table from it, validates every range itself,
and drops the reader (and so the mapping) before returning: expert bytes are then read with
explicit reads only, never through a mapping (Windows serialises reads while one is alive).
Stacked ``blk.N.ffn_{gate,up,gate_up,down}_exps`` tensors (numpy order ``[E, rows, cols]``) are
split per expert; one expert's slice of a stacked tensor is contiguous.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence

from colibri.formats._base import (
    FormatError,
    TensorInfo,
    WeightSource,
    assemble_experts,
    check_extents,
    file_size,
)

__all__ = ["gguf_source", "gguf_tensors", "open_gguf"]

_PLAIN = {"F64": "F64", "F32": "F32", "F16": "F16", "BF16": "BF16", "I8": "I8", "I16": "I16",
          "I32": "I32", "I64": "I64"}  # fmt: skip


# GGUF value types: fixed sizes of the scalars; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 4  # arrays of arrays: llama.cpp writes none; the reader recurses on each level


def _scan_metadata(path: str, f, size: int, n_kv: int) -> None:
    """Walk the key/value section as GGUF lays it out, refusing what the file cannot hold.

    ``gguf.GGUFReader`` loops over an array's declared count element by element, appending an
    empty part for each one past the end of the file: a corrupt count of 2**56 would run for
    ever and fill memory. Here each count is checked against the bytes left first.
    """

    def fail(what: str, at: int) -> FormatError:
        return FormatError(f"{path}: GGUF metadata at byte {at}: {what}; the file is corrupt")

    def take(n: int, at: int, what: str) -> bytes:
        if n < 0 or at + n > size:
            raise fail(f"{what} runs past the end of the file ({size} bytes)", at)
        f.seek(at)
        return f.read(n)

    def string(at: int, what: str) -> int:
        (n,) = struct.unpack("<Q", take(8, at, what + " length"))
        if n > size - at - 8:
            raise fail(f"{what} of {n} bytes runs past the end of the file ({size} bytes)", at)
        return at + 8 + n

    def value(kind: int, at: int, depth: int) -> int:
        if kind in _SCALAR_BYTES:  # only its extent matters here: the reader decodes it
            if at + _SCALAR_BYTES[kind] > size:
                raise fail(f"a value runs past the end of the file ({size} bytes)", at)
            return at + _SCALAR_BYTES[kind]
        if kind == _STRING:
            return string(at, "a string")
        if kind != _ARRAY:
            raise fail(f"unknown value type {kind}", at)
        if depth >= _MAX_NESTING:
            raise fail(f"arrays nested more than {_MAX_NESTING} deep", at)
        item, count = struct.unpack("<IQ", take(12, at, "an array header"))
        at += 12
        least = _SCALAR_BYTES.get(item, 8 if item == _STRING else 12)
        if count * least > size - at:
            raise fail(f"an array of {count} items of type {item} needs more than the "
                       f"{size - at} bytes left", at)  # fmt: skip
        if item in _SCALAR_BYTES:
            return at + count * least
        for _ in range(count):
            at = value(item, at, depth + 1)
        return at

    at = 24
    for _ in range(n_kv):
        at = string(at, "a key")
        (kind,) = struct.unpack("<I", take(4, at, "a value type"))
        at = value(kind, at + 4, 0)


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError(
            "reading GGUF files needs the 'gguf' package: pip install colibri-moe[formats]"
        ) from None
    return gguf


def open_gguf(path: str | os.PathLike) -> WeightSource:
    """Open a ``.gguf`` file as a :class:`WeightSource`.

    Quantized experts (``Q4_K``, ...) keep their ggml type name as ``dtype`` and are viewed as
    ``uint8 [rows, row_bytes]`` blocks.
    """
    path = os.path.abspath(os.fspath(path))
    source = gguf_source((path,), gguf_tensors(path))
    if not source.experts:
        raise FormatError(
            f"{path}: no routed-expert tensors found (names like 'blk.0.ffn_gate_exps.weight')"
        )
    return source


def gguf_source(files: Sequence[str], tensors: Mapping[str, TensorInfo]) -> WeightSource:
    """The routed experts among ``tensors`` (from :func:`gguf_tensors` of ``files``: one file,
    or every part of a split model) as a :class:`WeightSource`, stacked ``[E, ...]`` tensors
    split per expert; no experts: an empty one."""
    return WeightSource("gguf", tuple(files), assemble_experts(files[0], tensors))


def gguf_tensors(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a ``.gguf`` file, by name: its absolute offset, bytes, ggml type name
    (``F32``, ``Q8_0``, ...) and numpy-order shape, each range checked against the file (the
    metadata walked with bounds first: the file is untrusted)."""
    gguf = _import_gguf()
    path = os.path.abspath(os.fspath(path))
    size = file_size(path)
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise FormatError(f"{path}: not a GGUF file (bad magic or shorter than its header)")
    n_tensors, n_kv = struct.unpack("<QQ", head[8:24])
    # Each tensor info and key/value pair takes at least 8 + 4 bytes; more than the file can
    # hold means a corrupt count that would make the parser loop for ever.
    if n_tensors > size // 12 or n_kv > size // 12:
        raise FormatError(
            f"{path}: header claims {n_tensors} tensors and {n_kv} metadata pairs, more than "
            f"a {size}-byte file can hold; the file is corrupt"
        )
    with open(path, "rb") as f:
        _scan_metadata(path, f, size, n_kv)
    try:
        reader = gguf.GGUFReader(path, "r")
        tensors = {}
        for t in reader.tensors:
            qtype = t.tensor_type.name
            block, tsize = gguf.GGML_QUANT_SIZES[t.tensor_type]
            dims = tuple(int(d) for d in reversed(t.shape.tolist()))
            dtype = _PLAIN.get(qtype, qtype)
            tensors[t.name] = TensorInfo(
                t.name, path, int(t.data_offset), int(t.n_bytes), dtype, dims,
                (1, 0) if qtype in _PLAIN else (int(block), int(tsize)),
            )  # fmt: skip
        data_start = int(reader.data_offset)
        del reader
    except FormatError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError,
            struct.error, TypeError) as exc:  # fmt: skip
        raise FormatError(f"{path}: the GGUF header is corrupt or truncated ({exc})") from None
    check_extents(path, size, data_start, tensors.values())
    return tensors
