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

from colibri.formats._base import (
    FormatError,
    TensorInfo,
    WeightSource,
    assemble_experts,
    check_extents,
    file_size,
)

__all__ = ["open_gguf"]

_PLAIN = {"F64": "F64", "F32": "F32", "F16": "F16", "BF16": "BF16", "I8": "I8", "I16": "I16",
          "I32": "I32", "I64": "I64"}  # fmt: skip


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
    experts = assemble_experts(path, tensors)
    if not experts:
        raise FormatError(
            f"{path}: no routed-expert tensors found (names like 'blk.0.ffn_gate_exps.weight')"
        )
    return WeightSource("gguf", (path,), experts)
