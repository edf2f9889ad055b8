"""A checkpoint's routed experts block-quantized: :func:`quantize_checkpoint` (``colibri
quantize SRC DST --type q4_k``).

SRC is a transformers checkpoint directory (``config.json``, ``model.safetensors`` or shards
with their index) whose routed experts are float32, float16 or bfloat16. DST gets the same
files: every routed-expert tensor rewritten as rows of GGUF blocks of ``--type`` (stored
``U8 [..., rows, row_bytes]`` under its own name, each expert's matrices contiguous as
before, the type in the file's ``__metadata__`` and in config.json's
``colibri_quantization``), every other tensor byte for byte, every other file copied.
:func:`colibri.integrations.transformers.from_pretrained` and ``colibri generate`` load DST
with the experts paged as stored and computed by the quantized kernels.

DST is written into a temporary directory beside it, re-opened with colibri's own reader and
checked (every expert tensor dequantizes within its type's bound of the source), then
renamed into place: an error or an interrupt leaves no DST. SRC is only read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator

import numpy as np

from colibri._json import MAX_BYTES
from colibri._regular import open_regular
from colibri.formats import TensorInfo
from colibri.formats.safetensors import QUANTIZATION_KEY, QUANTIZED_BLOCKS
from colibri.integrations.transformers._checkpoint import (
    QUANTIZATION_CONFIG,
    TORCH_DTYPES,
    Checkpoint,
    read_bytes,
    read_json,
)
from colibri.layer import check_row_values, dequantize, quantize

__all__ = ["ERROR_BOUNDS", "quantize_checkpoint"]

#: Largest relative RMS error ``|dequantize(q) - x| / |x|`` over an expert tensor that the
#: check after writing accepts, per type: about twice what Gaussian weights give (q8_0 0.5%,
#: q6_k 1.8%, q5_k 3.6%, q4_k 7.2%, iq4_xs 7.7%, q4_0 8.6%, mxfp4 11.6%); real weights
#: with outliers stay inside it, a scale out of float16's range does not.
ERROR_BOUNDS = {"q8_0": 0.01, "q6_k": 0.04, "q5_k": 0.08, "q4_k": 0.15, "iq4_xs": 0.15,
                "q4_0": 0.2, "mxfp4": 0.25}  # fmt: skip

_SOURCE_DTYPES = ("F32", "F16", "BF16")
_CHUNK_BYTES = 64 << 20  # source bytes quantized at once
_ALIGN = 8  # the safetensors header is padded with spaces to a multiple of 8 bytes


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    qtype: str,
    *,
    force: bool = False,
    num_threads: int = 0,
    progress: bool = False,
) -> dict:
    """Write checkpoint ``src`` to ``dst`` with its routed experts quantized to ``qtype``.

    Parameters
    ----------
    src, dst : path-like
        The source checkpoint directory (only read) and the directory to create.
    qtype : str
        A block type colibri computes: ``q8_0``, ``q4_0``, ``q4_k``, ``q5_k``, ``q6_k``,
        ``iq4_xs`` or ``mxfp4``.
    force : bool
        Replace an existing ``dst`` (only once the new one is written and checked).
    num_threads : int
        Quantizer threads; 0: all.
    progress : bool
        A tqdm bar on stderr (when tqdm is installed and stderr a terminal).

    Returns
    -------
    dict
        ``experts`` (tensors quantized), ``source_bytes`` and ``expert_bytes`` (their bytes
        before and after), ``max_error`` (the largest relative RMS error measured) and
        ``bound`` (the type's :data:`ERROR_BOUNDS`).

    Raises
    ------
    FileExistsError
        ``dst`` exists and ``force`` is false.
    ValueError
        ``dst`` is ``src`` or inside it (or the reverse), an unknown type, an expert row
        length the type cannot split (naming tensor, type and length), an expert tensor not
        float32/float16/bfloat16, NaN or inf in an expert tensor (naming it), or the check
        after writing failed.
    CheckpointError
        ``src`` is not a checkpoint colibri reads.
    """
    if qtype not in QUANTIZED_BLOCKS:
        raise ValueError(
            f"quantize: the type must be one of {', '.join(QUANTIZED_BLOCKS)} (got {qtype!r})"
        )
    src, dst = os.path.realpath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    real_dst = os.path.realpath(dst)
    if real_dst == src or os.path.commonpath([src, real_dst]) in (src, real_dst):
        raise ValueError(
            f"quantize: DST {dst} and SRC {src} overlap; SRC is never modified: write DST "
            "outside it"
        )
    if os.path.lexists(dst) and not force:
        raise FileExistsError(f"quantize: {dst} already exists; pass --force to replace it")
    checkpoint = Checkpoint(src)
    plan = _plan(checkpoint, qtype)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dst)}.quantize-")
    try:
        bar = _progress(sum(checkpoint.tensors[n].nbytes for n in plan), progress)
        with bar:
            _write(checkpoint, work, qtype, plan, num_threads, bar.update)
        result = _verify(checkpoint, work, qtype, plan)
        _publish(work, dst, force)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return result


# -- what gets quantized ----------------------------------------------------------------------


def _plan(checkpoint, qtype: str) -> list[str]:
    """The expert tensors to quantize, each checked first (dtype, row length)."""
    names = checkpoint.expert_names()
    if not names:
        raise ValueError(f"quantize: {checkpoint.path} holds no routed-expert tensors")
    if checkpoint.config.get("model_type") == "gpt_oss":
        raise ValueError(
            f"quantize: {checkpoint.path} is a gpt-oss checkpoint, whose experts (one "
            "transposed gate_up tensor with gate and up interleaved, and biases) colibri "
            "quantize does not rewrite; gpt-oss is released with MXFP4 experts, which "
            "from_pretrained pages as they are"
        )
    for name in names:
        info = checkpoint.tensors[name]
        if info.dtype not in _SOURCE_DTYPES:
            raise ValueError(
                f"quantize: {info.path}: expert tensor {name!r} is stored as {info.dtype}; "
                "colibri quantize reads float32, float16 and bfloat16 experts"
            )
        try:
            check_row_values(qtype, info.shape[-1])
        except ValueError as exc:
            raise ValueError(f"quantize: {info.path}: expert tensor {name!r}: {exc}") from None
    return names


def _chunks(f, info, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, float32 [rows, cols])`` of a float tensor read in chunks of rows."""
    cols, rows, row_bytes = info.shape[-1], math.prod(info.shape[:-1]), _row_bytes(info)
    for start in range(0, rows, rows_per_chunk):
        count = min(rows_per_chunk, rows - start)
        part = TensorInfo(info.name, info.path, info.offset + start * row_bytes,
                          count * row_bytes, info.dtype, (count, cols))  # fmt: skip
        data = read_bytes(f, part).view(TORCH_DTYPES[info.dtype]).reshape(count, cols)
        yield start, data.float().numpy()


def _row_bytes(info) -> int:
    """Bytes of one row (last axis) of a tensor as stored."""
    return info.nbytes // max(1, math.prod(info.shape[:-1]))


def _rows_per_chunk(info) -> int:
    return max(1, _CHUNK_BYTES // max(1, _row_bytes(info)))


# -- writing --------------------------------------------------------------------------------


def _write(checkpoint, work: str, qtype: str, plan: list[str], threads: int, advance) -> None:
    """Every file of the checkpoint into ``work``: shards rewritten, the rest copied."""
    quantized = set(plan)
    by_file: dict[str, list] = {}
    for info in checkpoint.tensors.values():
        by_file.setdefault(info.path, []).append(info)
    total = 0
    for path, infos in by_file.items():
        infos.sort(key=lambda t: t.offset)
        entries = []
        for t in infos:
            if t.name in quantized:
                values, size = QUANTIZED_BLOCKS[qtype]
                row = t.shape[-1] // values * size
                shape = (*t.shape[:-1], row)
                entries.append((t.name, "U8", shape, math.prod(shape)))
            else:
                entries.append((t.name, t.dtype, t.shape, t.nbytes))
        types = {t.name: qtype for t in infos if t.name in quantized}
        metadata = {"format": "pt", QUANTIZATION_KEY: json.dumps(types)}
        with open_regular(path, "the weights file") as f:
            data = _tensor_data(f, infos, quantized, qtype, threads, advance)
            total += _write_safetensors(os.path.join(work, os.path.basename(path)), entries,
                                        metadata, data)  # fmt: skip
    weights = os.path.basename(checkpoint.weights)
    if weights.endswith(".index.json"):
        index = read_json(checkpoint.weights, "the shard index", MAX_BYTES)
        index.setdefault("metadata", {})["total_size"] = total
        _write_json(os.path.join(work, weights), index)
    config = {
        **checkpoint.config,
        QUANTIZATION_CONFIG: {"type": qtype, "tensors": "routed experts"},
    }
    _write_json(os.path.join(work, "config.json"), config)
    rewritten = {"config.json", weights, *(os.path.basename(p) for p in by_file)}
    for name in sorted(os.listdir(checkpoint.path)):
        if name in rewritten:
            continue
        source = os.path.join(checkpoint.path, name)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(work, name))
        else:
            shutil.copy2(source, os.path.join(work, name))


def _tensor_data(f, infos, quantized, qtype, threads, advance) -> Iterator[bytes]:
    """Each tensor's bytes, in order, as pieces: copied, or quantized chunk by chunk."""
    for t in infos:
        if t.name not in quantized:
            f.seek(t.offset)
            left = t.nbytes
            while left:
                piece = f.read(min(left, _CHUNK_BYTES))
                if not piece:
                    raise OSError(f"{t.path}: tensor {t.name!r} was truncated while read")
                left -= len(piece)
                yield piece
            continue
        for start, x in _chunks(f, t, _rows_per_chunk(t)):
            try:
                blocks = quantize(x, qtype, threads)
            except ValueError as exc:
                raise ValueError(
                    f"quantize: {t.path}: expert tensor {t.name!r} (from row {start}): {exc}"
                ) from None
            advance(x.shape[0] * _row_bytes(t))
            yield blocks.tobytes()


def _write_safetensors(path: str, entries, metadata: dict, data: Iterator[bytes]) -> int:
    """A safetensors file, streamed: ``entries`` ``(name, dtype, shape, nbytes)`` in order,
    their bytes from ``data``; returns the data section's size."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    written = 0
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for piece in data:
            out.write(piece)
            written += len(piece)
        out.flush()
        os.fsync(out.fileno())
    if written != offset:  # pragma: no cover - a tensor read short raises before
        raise OSError(f"{path}: wrote {written} data bytes, the header says {offset}")
    return offset


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump(value, out, indent=2, ensure_ascii=False)
        out.write("\n")


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    return tqdm(total=total, desc="quantize", unit="B", unit_scale=True, dynamic_ncols=True)


class _NoBar(contextlib.nullcontext):
    def update(self, _n: int) -> None:
        """No bar: nothing to advance."""


# -- checking and publishing -------------------------------------------------------------


def _verify(checkpoint, work: str, qtype: str, plan: list[str]) -> dict:
    """Re-open ``work`` with colibri's reader and measure every expert tensor's error."""
    written = Checkpoint(work)
    written.expert_source()  # the pager's view builds
    if set(written.tensors) != set(checkpoint.tensors):
        raise ValueError(f"quantize: {work} lost or gained tensors while written")
    worst, source_bytes, expert_bytes = 0.0, 0, 0
    for name in plan:
        before, after = checkpoint.tensors[name], written.tensors[name]
        if after.dtype != qtype.upper() or after.shape != before.shape:
            raise ValueError(
                f"quantize: {after.path}: tensor {name!r} reads back as {after.dtype} "
                f"{list(after.shape)}, not {qtype} {list(before.shape)}"
            )
        err2 = norm2 = 0.0
        row_bytes = _row_bytes(after)
        with open_regular(before.path, "the weights file") as f, open(after.path, "rb") as g:
            for start, x in _chunks(f, before, _rows_per_chunk(before)):
                count = x.shape[0] * row_bytes
                part = TensorInfo(name, after.path, after.offset + start * row_bytes, count,
                                  "U8", (count,))  # fmt: skip
                blocks = read_bytes(g, part).numpy().reshape(x.shape[0], row_bytes)
                diff = dequantize(qtype, blocks) - x
                err2 += float(np.dot(diff.ravel(), diff.ravel()))
                norm2 += float(np.dot(x.ravel(), x.ravel()))
        error = math.sqrt(err2 / norm2) if norm2 else math.sqrt(err2)
        if not error <= ERROR_BOUNDS[qtype]:  # NaN fails too
            raise ValueError(
                f"quantize: expert tensor {name!r} dequantizes with a relative RMS error of "
                f"{error:.4g}, more than {qtype}'s bound {ERROR_BOUNDS[qtype]} (weights too "
                "small or too large for its float16 scales?); try a type with more bits"
            )
        worst = max(worst, error)
        source_bytes += before.nbytes
        expert_bytes += after.nbytes
    return {"experts": len(plan), "source_bytes": source_bytes, "expert_bytes": expert_bytes,
            "max_error": worst, "bound": ERROR_BOUNDS[qtype]}  # fmt: skip


def _publish(work: str, dst: str, force: bool) -> None:
    """Rename the checked ``work`` to ``dst``; an existing ``dst`` (``force``) is moved
    aside first and removed only once the new one is in place."""
    old = None
    if os.path.lexists(dst):
        if not force:  # appeared while writing
            raise FileExistsError(f"quantize: {dst} already exists; pass --force to replace it")
        old = tempfile.mkdtemp(dir=os.path.dirname(dst), prefix=f".{os.path.basename(dst)}.old-")
        os.rename(dst, os.path.join(old, "dst"))
    try:
        os.rename(work, dst)
    except BaseException:
        if old is not None:
            os.rename(os.path.join(old, "dst"), dst)
            os.rmdir(old)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
