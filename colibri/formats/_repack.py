"""Repack expert weights so each group of a partition is contiguous on disk.

``repack(source, dest, partition)`` writes a colibri raw file in which, per layer, the experts
of group 0 come first, then group 1, ...; each expert's ``gate``, ``up`` and ``down`` are
adjacent (one read per expert) and each expert starts on a page boundary, so no page is shared
between experts for a Pager of that page size or smaller. The manifest records the partition
(``metadata["groups"]``), the page size (``metadata["page_size"]``) and every expert's offsets,
so ``(layer, expert)`` still names the same weights. The source is
only read; the output is written to a temporary file, checked byte for byte against the
source, then renamed into place.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping

import numpy as np

from colibri import _groups
from colibri._files import FileReader
from colibri._validate import check_page_size_kb
from colibri.formats._base import WeightSource
from colibri.formats._open import open_weights
from colibri.formats.raw import RawWriter

__all__ = ["repack"]


def _layer_groups(partition, layer: int, experts: set[int]) -> list[list[int]]:
    if isinstance(partition, Mapping):
        if layer not in partition:
            raise ValueError(f"repack(): the partition mapping has no entry for layer {layer}")
        partition = partition[layer]
    groups = getattr(partition, "groups", partition)
    if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Iterable):
        raise TypeError(
            "repack(): partition must have .groups or be a list of lists of expert ids "
            f"(got {type(partition).__name__})"
        )
    groups = [list(g) for g in _groups.parse(groups, "repack(): partition")]
    wrong = _groups.coverage(groups, experts)
    if wrong:
        raise ValueError(
            f"repack(): layer {layer}: the partition must list every expert "
            f"{sorted(experts)} exactly once in non-empty groups (missing "
            f"{list(wrong.missing)}, unknown {sorted({e for e, _ in wrong.unknown})}, "
            f"repeated {sorted({e for e, *_ in wrong.repeated})})"
        )
    return groups


def _read_expert(reader: FileReader, layout) -> list[tuple[str, tuple, np.ndarray]]:
    out = []
    for ref in layout.matrices:
        buf = np.empty(ref.nbytes, dtype=np.uint8)
        reader.readinto(ref.path, ref.offset, memoryview(buf))
        out.append((ref.dtype, ref.shape, buf))
    return out


def repack(
    source: str | os.PathLike | WeightSource,
    dest: str | os.PathLike,
    partition,
    *,
    page_size_kb: int = 64,
    overwrite: bool = False,
) -> WeightSource:
    """Write ``source``'s experts to ``dest`` with each partition group contiguous.

    Parameters
    ----------
    source : path-like or WeightSource
        Any weight file ``open_weights`` reads (never modified).
    dest : path-like
        New colibri raw file (manifest at ``<dest>.json``).
    partition : Partition, list of lists, or mapping
        Object with ``.groups`` (a tuple of tuples of expert ids) or a list of lists, used for
        every layer; or ``{layer: partition}`` for per-layer partitions.
    page_size_kb : int
        Every expert starts on a boundary of pages of this size (a power of two >= 4; the
        Pager's ``page_size_kb``, 64 by default). A Pager with pages this size or smaller
        then charges each expert only its own pages.
    overwrite : bool
        Replace an existing ``dest`` (never a source file).

    Returns
    -------
    WeightSource
        The new file, opened and validated.
    """
    page_size = check_page_size_kb(page_size_kb, "repack(): ") * 1024
    src = open_weights(source)
    if any(layout.scales is not None for layout in src.experts.values()):
        raise ValueError(
            "repack(): the source's experts are float8 with block scales, which colibri's raw "
            "format does not hold; page the safetensors checkpoint as it is"
        )
    dest = os.path.abspath(os.fspath(dest))
    for f in src.files:
        if os.path.exists(dest) and os.path.samefile(f, dest):
            raise ValueError(f"repack(): {dest} is the source file; write to a new path")
    per_layer = {}
    for layer in src.layers:
        ids = {e for (lay, e) in src.experts if lay == layer}
        per_layer[layer] = _layer_groups(partition, layer, ids)
    digests: dict[tuple[int, int], bytes] = {}
    meta = {
        "groups": {str(k): v for k, v in per_layer.items()},
        "source_format": src.format,
        "page_size": page_size,
    }
    with FileReader(src.files) as reader:
        writer = RawWriter(dest, alignment=page_size, overwrite=overwrite, metadata=meta)
        try:
            for layer, groups in per_layer.items():
                for group in groups:
                    for e in group:
                        mats = _read_expert(reader, src.experts[(layer, e)])
                        h = hashlib.blake2b(digest_size=32)
                        for _, _, buf in mats:
                            h.update(buf)
                        digests[(layer, e)] = h.digest()
                        writer.add(layer, e, mats)
        except BaseException:
            writer.abort()
            raise

    def check(tmp: str, entries: list[dict]) -> None:
        with FileReader([tmp]) as written:
            for entry in entries:
                h = hashlib.blake2b(digest_size=32)
                for proj in ("gate", "up", "down"):
                    m = entry["matrices"][proj]
                    buf = np.empty(m["nbytes"], dtype=np.uint8)
                    written.readinto(tmp, m["offset"], memoryview(buf))
                    h.update(buf)
                key = (entry["layer"], entry["expert"])
                if h.digest() != digests[key]:
                    raise OSError(
                        f"repack(): layer {key[0]} expert {key[1]} reads back different from "
                        f"the source; {dest} was not written"
                    )

    writer.commit(check)
    return open_weights(dest)
