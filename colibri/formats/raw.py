"""colibri's own expert file: raw bytes plus a JSON manifest.

``write_experts("model.colibri", experts)`` writes ``model.colibri`` (the bytes) and
``model.colibri.json`` (the manifest). Each expert's ``gate``, ``up`` and ``down`` matrices are
adjacent, so one read fetches the whole expert, and each expert starts on an ``alignment``
boundary (default 4096 bytes). The manifest records, per expert, the absolute offset, dtype and
shape of each matrix, plus optional metadata (a repacked file stores its ``groups`` there).
The manifest names the data file, and replacing the manifest (one rename) is the only commit
point. A new file's data is ``model.colibri``; an overwrite writes its data to whichever of
``model.colibri`` and ``model.colibri.alt`` the current manifest does not name, renames the new
manifest into place, then removes the superseded data. A process killed at any moment leaves the
previous file whole or the new one complete; what a dead write left (its temporaries, unnamed
data) is removed by the next write or open of the same file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Mapping

import numpy as np

from colibri import _json
from colibri._atomic_file import publish, refuse_existing, sweep, sync_folder, temporary_beside
from colibri.formats._base import (
    DTYPE_SIZES,
    MAX_INDEX,
    ExpertLayout,
    FormatError,
    TensorInfo,
    TensorRef,
    WeightSource,
    check_extents,
    file_size,
    numpy_dtype,
)

__all__ = ["RawWriter", "manifest_path", "open_raw", "write_experts"]

FORMAT_NAME = "colibri-experts"
FORMAT_VERSION = 1
_PROJS = ("gate", "up", "down")
_TOKEN_BYTES = 16
_QUANT_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,15}")


def manifest_path(path: str | os.PathLike) -> str:
    """The manifest that belongs to a raw data file (``<path>.json``)."""
    return os.fspath(path) + ".json"


def alternate(path: str | os.PathLike) -> str:
    """The second data name of a raw file (``<path>.alt``): an overwrite writes the data name
    the current manifest does not use, so the previous data stays whole until the new manifest
    replaces the old one."""
    return os.fspath(path) + ".alt"


def _named_data(mpath: str) -> str | None:
    """The data file name ``mpath`` names, or None if it is missing or not a raw manifest."""
    try:
        manifest = _json.load(mpath, what="the manifest")
    except (OSError, FormatError):
        return None
    data = manifest.get("data") if isinstance(manifest, dict) else None
    return data if isinstance(data, str) else None


def _sweep(mpath: str, data: str) -> None:
    """Remove what dead writes of ``mpath``'s file left: their temporaries, and the data name
    the manifest does not name (the data of an interrupted or a superseded write)."""
    base = mpath[: -len(".json")]
    if sweep(base) | sweep(mpath):  # a write is under way: the unnamed data may be its own
        return
    names = {os.path.basename(base): base, os.path.basename(alternate(base)): alternate(base)}
    if data not in names:  # not written by RawWriter: leave the folder alone
        return
    for name, stale in names.items():
        if name != data:
            with contextlib.suppress(OSError):
                os.unlink(stale)


def stored_dtype(dtype: np.dtype) -> str:
    """Stored name of a numpy dtype (``float16 -> "F16"``, ``bfloat16 -> "BF16"``)."""
    dtype = np.dtype(dtype)
    for name in DTYPE_SIZES:
        if numpy_dtype(name) == dtype and name not in ("BF16", "F8_E4M3", "F8_E5M2"):
            return name
    special = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
    if dtype.name in special:
        return special[dtype.name]
    raise TypeError(f"write_experts(): dtype {dtype} cannot be stored (use {list(DTYPE_SIZES)})")


class RawWriter:
    """Stream experts into a new raw file; ``commit()`` publishes it with one rename.

    Parameters
    ----------
    path : path-like
        Final data file; the manifest goes to ``<path>.json``.
    alignment : int
        Byte alignment of each expert's first matrix (a power of two).
    overwrite : bool
        Replace existing files instead of refusing.
    metadata : dict, optional
        JSON-serialisable extras stored in the manifest.
    """

    def __init__(self, path, *, alignment: int = 4096, overwrite: bool = False,
                 metadata: dict | None = None) -> None:  # fmt: skip
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two (got {alignment!r})")
        self.path = os.path.abspath(os.fspath(path))
        self.manifest = manifest_path(self.path)
        self.overwrite = overwrite
        for p in (self.path, self.manifest):
            refuse_existing(p, overwrite)
        self.alignment = alignment
        self.metadata = dict(metadata or {})
        self._entries: list[dict] = []
        self._keys: set[tuple[int, int]] = set()
        fd, self._tmp = temporary_beside(self.path)
        self._file = os.fdopen(fd, "wb")
        self._offset = 0

    def add(self, layer: int, expert: int, matrices: Iterable[tuple[str, tuple, object]]) -> None:
        """Append one expert: ``matrices`` are ``(stored dtype, shape, bytes_like)`` for gate,
        up, down in that order (the stored dtype, ``"F16"``..., may be a GGUF quantization,
        stored as raw blocks)."""
        key = (int(layer), int(expert))
        if key in self._keys:
            raise ValueError(f"layer {layer} expert {expert} was added twice")
        self._keys.add(key)
        pad = -self._offset % self.alignment
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        entry = {"layer": key[0], "expert": key[1], "matrices": {}}
        matrices = list(matrices)
        if len(matrices) != 3:
            raise ValueError(f"an expert has 3 matrices (gate, up, down), got {len(matrices)}")
        for proj, (dtype, shape, data) in zip(_PROJS, matrices, strict=True):
            if isinstance(data, np.ndarray):  # ml_dtypes' float8 has no buffer format
                data = np.ascontiguousarray(data).view(np.uint8)
            view = memoryview(data).cast("B")
            entry["matrices"][proj] = {
                "dtype": dtype, "shape": [int(d) for d in shape], "offset": self._offset,
                "nbytes": len(view),
            }  # fmt: skip
            self._file.write(view)
            self._offset += len(view)
        self._entries.append(entry)

    def commit(self, check=None) -> str:
        """Flush the data, publish it under the data name the manifest does not use, then
        rename the new manifest into place (the one commit point); returns ``path``.

        ``check(tmp_path, entries)``, when given, runs on the finished temporary file before
        anything is published; if it raises, nothing is published and the temporary is removed.
        """
        # The data ends with a random token the manifest repeats, so a manifest never pairs
        # with data it was not written with unnoticed (open_raw compares the tokens).
        token = os.urandom(_TOKEN_BYTES)
        try:
            self._file.write(token)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if check is not None:
                check(self._tmp, self._entries)
        except BaseException:
            self.abort()
            raise
        current = _named_data(self.manifest)  # what readers load until the commit
        target = self.path if current != os.path.basename(self.path) else alternate(self.path)
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION,
            "data": os.path.basename(target), "data_bytes": self._offset + _TOKEN_BYTES,
            "token": token.hex(), "alignment": self.alignment, "metadata": self.metadata,
            "experts": self._entries,
        }  # fmt: skip
        fd, tmp_manifest = temporary_beside(self.manifest)
        linked = False
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            if self.overwrite or target != self.path:  # target is unused: a dead write's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target)
            publish(self._tmp, target, overwrite=False, keep=True)
            linked = True
            sync_folder(target)  # the data's name reaches the disk before the manifest's
            publish(tmp_manifest, self.manifest, overwrite=self.overwrite)  # the commit
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_manifest)
            if linked:  # nothing names it: the previous manifest names the other data name
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target)
            self.abort()
            raise
        sync_folder(self.manifest)
        superseded = alternate(self.path) if target == self.path else self.path
        with contextlib.suppress(OSError):  # no longer named; the next open retries
            os.unlink(superseded)
        self.abort()  # the temporary, now a second name of the published data
        return self.path

    def abort(self) -> None:
        """Drop the temporary file; the final paths are left untouched."""
        if not self._file.closed:
            with contextlib.suppress(OSError):  # a full disk fails the last flush as well
                self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def __enter__(self) -> RawWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_experts(
    path: str | os.PathLike,
    experts: Mapping[tuple[int, int], tuple] | Iterable[tuple[tuple[int, int], tuple]],
    *,
    alignment: int = 4096,
    overwrite: bool = False,
    metadata: dict | None = None,
) -> str:
    """Write experts to colibri's raw format.

    Parameters
    ----------
    path : path-like
        Data file to create; the manifest is ``<path>.json``.
    experts : mapping or iterable
        ``(layer, expert) -> (gate [I, H], up [I, H], down [H, I])`` numpy arrays, written in
        iteration order.
    alignment, overwrite, metadata
        See :class:`RawWriter`.

    Returns
    -------
    str
        The absolute data path (pass it to ``open_weights`` or ``Pager``).
    """
    items = experts.items() if isinstance(experts, Mapping) else experts
    with RawWriter(path, alignment=alignment, overwrite=overwrite, metadata=metadata) as w:
        for (layer, expert), (gate, up, down) in items:
            gate, up, down = (np.ascontiguousarray(m) for m in (gate, up, down))
            if gate.ndim != 2 or up.shape != gate.shape or down.shape != gate.shape[::-1]:
                raise ValueError(
                    f"write_experts(): layer {layer} expert {expert} needs gate [I, H], up [I, H],"
                    f" down [H, I] (got {gate.shape}, {up.shape}, {down.shape})"
                )
            w.add(layer, expert, [(stored_dtype(m.dtype), m.shape, m) for m in (gate, up, down)])
    return w.path


def _fail(path: str, why: str) -> FormatError:
    return FormatError(f"{path}: {why}")


def _matrix(m: object, mpath: str, key: str, dpath: str, name: str) -> TensorInfo:
    m = _json.mapping(m, mpath, key)
    get = {f: _json.field(m, f, mpath, f"{key}.") for f in ("dtype", "shape", "offset", "nbytes")}
    dtype = _json.string(get["dtype"], mpath, f"{key}.dtype")
    shape = _json.int_list(get["shape"], mpath, f"{key}.shape", min_len=2, max_len=2)
    offset = _json.integer(get["offset"], mpath, f"{key}.offset")
    nbytes = _json.integer(get["nbytes"], mpath, f"{key}.nbytes")
    block = (1, 0)
    if dtype not in DTYPE_SIZES:  # a GGUF quantization stored as raw blocks, one per row
        if not _QUANT_NAME.fullmatch(dtype):
            raise _fail(mpath, f"{key + '.dtype'!r} must be a safetensors or GGUF dtype name "
                        f"(got {_json.show(dtype)})")  # fmt: skip
        rows = shape[0]
        if rows == 0 or nbytes % rows:
            raise _fail(mpath, f"{key + '.nbytes'!r} must be a whole number of the {rows} rows "
                        f"of a quantized matrix (got {nbytes})")  # fmt: skip
        block = (shape[1], nbytes // rows)
    return TensorInfo(name, dpath, offset, nbytes, dtype, tuple(shape), block)


def open_raw(path: str | os.PathLike) -> WeightSource:
    """Open a raw file from its data path or its manifest path; validate every entry."""
    path = os.path.abspath(os.fspath(path))
    mpath = path if path.endswith(".json") else manifest_path(path)
    file_size(mpath)  # FileNotFoundError naming the path
    manifest = _json.load(mpath, what="the manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise _fail(mpath, f'not a colibri manifest (no "format": "{FORMAT_NAME}")')
    if manifest.get("version") != FORMAT_VERSION:
        raise _fail(
            mpath, f"'version' must be {FORMAT_VERSION} (got {_json.show(manifest.get('version'))})"
        )
    data = _json.string(_json.field(manifest, "data", mpath), mpath, "data")
    if data in ("", ".", "..") or any(c in data for c in "/\\\0") or os.path.isabs(data):
        raise _fail(
            mpath, f"'data' must be a file name next to the manifest (got {_json.show(data)})"
        )
    dpath = os.path.join(os.path.dirname(mpath), data)
    size = file_size(dpath)
    data_bytes = _json.integer(_json.field(manifest, "data_bytes", mpath), mpath, "data_bytes")
    if data_bytes != size:
        raise _fail(
            dpath, f"is {size} bytes but its manifest says {data_bytes}; "
            "the file is truncated or does not belong to this manifest"
        )  # fmt: skip
    if "alignment" in manifest:
        _json.integer(manifest["alignment"], mpath, "alignment", lo=1)
    entries = _json.sequence(_json.field(manifest, "experts", mpath), mpath, "experts")
    tensors, experts = [], {}
    for i, entry in enumerate(entries):
        where = f"experts[{i}]"
        entry = _json.mapping(entry, mpath, where)
        key = tuple(
            _json.integer(_json.field(entry, f, mpath, f"{where}."), mpath, f"{where}.{f}",
                          hi=MAX_INDEX)
            for f in ("layer", "expert")
        )  # fmt: skip
        mats = _json.mapping(
            _json.field(entry, "matrices", mpath, f"{where}."), mpath, f"{where}.matrices"
        )
        infos = [
            _matrix(
                _json.field(mats, proj, mpath, f"{where}.matrices."), mpath,
                f"{where}.matrices.{proj}", dpath, f"layer {key[0]} expert {key[1]} {proj}",
            )
            for proj in _PROJS
        ]  # fmt: skip
        if key in experts:
            raise _fail(mpath, f"layer {key[0]} expert {key[1]} appears twice")
        gate, up, down = (
            TensorRef(t.name, t.path, t.offset, t.nbytes, t.dtype, t.shape) for t in infos
        )
        if up.shape != gate.shape or down.shape != gate.shape[::-1]:
            raise _fail(
                mpath, f"layer {key[0]} expert {key[1]} has inconsistent shapes: gate "
                f"{list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} (expected "
                "gate [I, H], up [I, H], down [H, I])"
            )  # fmt: skip
        tensors.extend(infos)
        experts[key] = ExpertLayout(key[0], key[1], gate, up, down)
    if not experts:
        raise _fail(mpath, "the manifest lists no experts")
    check_extents(dpath, size, 0, tensors)
    if "token" in manifest:  # written by RawWriter.commit at the end of the data
        token = _json.string(manifest["token"], mpath, "token")
        with open(dpath, "rb") as f:
            f.seek(max(size - _TOKEN_BYTES, 0))
            tail = f.read(_TOKEN_BYTES).hex()
        if tail != token:
            raise _fail(
                dpath, "does not end with the token its manifest names: data and manifest come "
                "from different writes (an overwrite was interrupted); write the file again"
            )  # fmt: skip
    meta = _json.mapping(manifest.get("metadata") or {}, mpath, "metadata")
    _sweep(mpath, data)
    return WeightSource("colibri-raw", (dpath,), experts, meta)
