"""A cheap fingerprint of the experts a rank owns, to refuse a checkpoint that differs.

Per expert: every matrix's name, dtype, shape and size, and a hash of a few sampled spans of
its bytes (the first, middle and last ``SAMPLE`` bytes), so that two copies of one checkpoint
agree and a different checkpoint (another model, another quantization, other weights) does
not, after reading a few KiB per expert instead of the whole share. It is no checksum: a byte
flipped elsewhere in a copy goes unnoticed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from colibri._regular import open_regular

__all__ = ["SAMPLE", "fingerprint"]

#: Bytes hashed at each sampled span of an expert matrix.
SAMPLE = 256


def fingerprint(source, experts: Iterable[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """``{(layer, expert): hex digest}`` of ``experts`` in ``source`` (a
    :class:`colibri.formats.WeightSource`).

    Raises
    ------
    OSError
        A file cannot be read (truncated files read short, which changes the digest).
    """
    refs = {key: source.layout(*key).matrices for key in experts}
    handles: dict[str, object] = {}
    out = {}
    try:
        for key, matrices in refs.items():
            digest = hashlib.blake2b(digest_size=16)
            for ref in matrices:
                digest.update(f"{ref.name}|{ref.dtype}|{tuple(ref.shape)}|{ref.nbytes}|".encode())
                f = handles.get(ref.path)
                if f is None:
                    f = handles[ref.path] = open_regular(ref.path, "the weights file")
                for start in sorted({0, max(ref.nbytes // 2 - SAMPLE // 2, 0),
                                     max(ref.nbytes - SAMPLE, 0)}):  # fmt: skip
                    f.seek(ref.offset + start)
                    digest.update(f.read(min(SAMPLE, ref.nbytes - start)))
            out[key] = digest.hexdigest()
    finally:
        for f in handles.values():
            f.close()
    return out
